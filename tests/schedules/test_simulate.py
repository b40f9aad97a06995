"""simulate: start times are the critical path of the dependency graph, costs are checked."""

import math
import random

import networkx as nx
import pytest

from schedules import Action, Op, Schedule, ScheduleError, gpipe, one_f_one_b, simulate

A = Action.parse


def _critical_path(schedule, forward, backward, comm):
    """Earliest start of every action and the makespan, from our own networkx DAG.

    Nodes are actions weighted by their stage's cost; edges are each stage's order
    (no delay) and the data rule for F/B one-chunk-per-stage schedules, with
    ``comm`` on the edges that cross stages.
    """
    graph = nx.DiGraph()
    cost = {Op.F: forward, Op.B: backward}
    stage_of = {}
    for stage, actions in enumerate(schedule.order):
        for action in actions:
            graph.add_node(action, cost=cost[action.op][stage])
            stage_of[action] = stage
        for before, after in zip(actions, actions[1:]):
            graph.add_edge(before, after, delay=0.0)
    for action, stage in stage_of.items():
        m, c = action.microbatch, action.chunk
        if action.op is Op.F:
            producers = [Action(Op.F, m, c - 1)] if c > 0 else []
        else:
            producers = [Action(Op.F, m, c)]
            if c + 1 < schedule.stages:
                producers.append(Action(Op.B, m, c + 1))
        for producer in producers:
            delay = comm if stage_of[producer] != stage else 0.0
            # Keep the larger delay if a stage-order edge is also a data edge.
            if graph.has_edge(producer, action):
                delay = max(delay, graph.edges[producer, action]["delay"])
            graph.add_edge(producer, action, delay=delay)
    start = {}
    for node in nx.topological_sort(graph):
        start[node] = max(
            (start[p] + graph.nodes[p]["cost"] + graph.edges[p, node]["delay"]
             for p in graph.predecessors(node)),
            default=0.0,
        )
    # Cross-check the makespan with networkx's own longest path on an edge-weighted copy.
    weighted = nx.DiGraph()
    for u, v, data in graph.edges(data=True):
        weighted.add_edge(u, v, weight=graph.nodes[u]["cost"] + data["delay"])
    for node, data in graph.nodes(data=True):
        weighted.add_edge(node, "end", weight=data["cost"])
    makespan = nx.dag_longest_path_length(weighted, weight="weight")
    return start, makespan


@pytest.mark.parametrize("generator", [gpipe, one_f_one_b])
@pytest.mark.parametrize("seed", range(6))
def test_makespan_is_the_critical_path_with_random_costs_and_comm(generator, seed):
    rng = random.Random(seed)
    stages, microbatches = rng.randint(1, 7), rng.randint(1, 12)
    forward = [rng.uniform(0.1, 3.0) for _ in range(stages)]
    backward = [rng.uniform(0.1, 5.0) for _ in range(stages)]
    comm = rng.uniform(0.05, 2.0)
    schedule = generator(stages, microbatches)

    timeline = simulate(schedule, forward=forward, backward=backward, comm=comm)
    start, makespan = _critical_path(schedule, forward, backward, comm)

    assert math.isclose(timeline.makespan, makespan, rel_tol=1e-12)
    assert len(timeline.events) == len(start)
    for event in timeline.events:
        assert math.isclose(event.start, start[event.action], rel_tol=1e-12, abs_tol=1e-12), event
        cost = (forward if event.action.op is Op.F else backward)[event.stage]
        assert math.isclose(event.duration, cost, rel_tol=1e-12)


def test_comm_adds_to_each_hop_of_the_ramp():
    # GPipe, equal costs: M forwards after (P-1) hops, then the backward ramp.
    stages, microbatches, comm = 4, 6, 0.5
    timeline = simulate(gpipe(stages, microbatches), forward=1, backward=2, comm=comm)
    ramp = (stages - 1) * (1 + comm) + (stages - 1) * (2 + comm)
    assert math.isclose(timeline.makespan, 3 * microbatches + ramp, rel_tol=1e-12)


def test_events_follow_each_stage_order_without_overlap():
    schedule = one_f_one_b(5, 9)
    timeline = simulate(schedule, forward=[1, 2, 1, 3, 1], backward=2.5, comm=0.25)
    for stage in range(schedule.stages):
        events = timeline.stage_events(stage)
        assert tuple(e.action for e in events) == schedule.order[stage]
        assert all(a.end <= b.start for a, b in zip(events, events[1:]))
    assert all(e.stage == schedule.placement[e.action.chunk] for e in timeline.events)


def test_timeline_metadata():
    timeline = simulate(one_f_one_b(4, 8))
    assert timeline.name == "1f1b (simulated)"
    assert timeline.stages == 4
    assert timeline.chunks_per_stage == (1, 1, 1, 1)
    assert timeline.start == 0.0


def test_makespan_bound_is_the_ramp_plus_the_busiest_stage():
    stages, microbatches = 4, 8
    timeline = simulate(one_f_one_b(stages, microbatches), forward=1, backward=2)
    assert timeline.makespan_bound == (stages - 1) + 3 * microbatches
    assert math.isclose(timeline.bubble_bound, (stages - 1) / (3 * microbatches + stages - 1))
    rng = random.Random(5)
    for _ in range(20):
        p, m = rng.randint(1, 6), rng.randint(1, 10)
        forward = [rng.uniform(0.1, 2) for _ in range(p)]
        backward = [rng.uniform(0.1, 4) for _ in range(p)]
        comm = rng.uniform(0, 1)
        # Stage s cannot start before micro-batch 0 crossed stages 0..s-1.
        expected = max(
            sum(forward[:s]) + s * comm + m * (forward[s] + backward[s]) for s in range(p)
        )
        for generator in (gpipe, one_f_one_b):
            timeline = simulate(generator(p, m), forward=forward, backward=backward, comm=comm)
            assert math.isclose(timeline.makespan_bound, expected, rel_tol=1e-12)
            assert timeline.makespan_bound <= timeline.makespan * (1 + 1e-12)


def test_split_backward_costs():
    split = Schedule(1, 1, [[A("F0"), A("I0"), A("W0")]])
    full = Schedule(1, 1, [[A("F0"), A("B0")]])
    # Without weight=, a split backward is half input grad, half weight grad.
    timeline = simulate(split, forward=1, backward=4)
    assert [e.duration for e in timeline.stage_events(0)] == [1, 2, 2]
    # With weight=, backward is the input grad alone and B costs both.
    timeline = simulate(split, forward=1, backward=4, weight=3)
    assert [e.duration for e in timeline.stage_events(0)] == [1, 4, 3]
    assert simulate(full, forward=1, backward=4, weight=3).makespan == 8
    assert simulate(full, forward=1, backward=4).makespan == 5


def test_several_chunks_per_stage_share_the_stage_cost():
    schedule = Schedule(
        2, 1,
        [
            [A("F0"), A("F0@c2"), A("B0@c2"), A("B0")],
            [A("F0@c1"), A("F0@c3"), A("B0@c3"), A("B0@c1")],
        ],
        placement=(0, 1, 0, 1),
    )
    timeline = simulate(schedule, forward=1, backward=2, comm=0)
    assert {e.duration for e in timeline.events if e.action.op is Op.F} == {0.5}
    assert {e.duration for e in timeline.events if e.action.op is Op.B} == {1.0}
    # Strictly sequential: 4 half-forwards, then 4 backwards of 1.
    assert timeline.makespan == 6.0
    assert timeline.chunks_per_stage == (2, 2)


def test_zero_costs():
    timeline = simulate(one_f_one_b(3, 4), forward=0, backward=0)
    assert timeline.makespan == 0.0
    assert timeline.bubble_fraction == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"forward": -1.0}, r"forward cost must be >= 0, got -1.0"),
        ({"backward": [1, -2, 1]}, r"backward cost must be >= 0, got -2.0"),
        ({"weight": -0.5}, r"weight cost must be >= 0, got -0.5"),
        ({"comm": -0.1}, r"comm must be >= 0, got -0.1"),
        ({"forward": [1, 2]}, r"forward cost: expected one number or 3 per-stage numbers, got 2"),
        ({"backward": [1, 2, 3, 4]}, r"backward cost: expected one number or 3 per-stage .*got 4"),
        ({"weight": []}, r"weight cost: expected one number or 3 per-stage numbers, got 0"),
    ],
)
def test_bad_costs_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        simulate(one_f_one_b(3, 4), **kwargs)


@pytest.mark.parametrize("name", ["forward", "backward", "weight", "comm"])
def test_nan_cost_is_rejected(name):
    with pytest.raises(ValueError, match=name):
        simulate(one_f_one_b(3, 4), **{name: float("nan")})


def test_numpy_scalar_costs_are_scalars():
    np = pytest.importorskip("numpy")
    timeline = simulate(one_f_one_b(3, 4), forward=np.int64(1), backward=np.float32(2))
    assert timeline.makespan == (4 + 3 - 1) * 3


def test_deadlocked_schedule_raises_schedule_error():
    order = [[A("F0"), A("B0"), A("F1"), A("B1")], [A("F0@c1"), A("F1@c1"), A("B0@c1"), A("B1@c1")]]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(Schedule(2, 2, order))


def test_incomplete_schedule_raises_schedule_error():
    with pytest.raises(ScheduleError, match="B0@c1 is missing from stage 1"):
        simulate(Schedule(2, 1, [[A("F0"), A("B0")], [A("F0@c1")]]))


def test_simulate_measured_reproduces_a_timeline_from_its_own_costs() -> None:
    from schedules import get_schedule, simulate_measured

    for name in ("1f1b", "zb-h1", "interleaved-1f1b", "zb-v"):
        schedule = get_schedule(name, 4, 8)
        costs = simulate(schedule, forward=[1, 2, 1, 1], backward=[2, 3, 2, 2], weight=[1, 1, 2, 1])
        again = simulate_measured(schedule, costs)
        assert again.makespan == pytest.approx(costs.makespan, rel=1e-12), name
        assert again.bubble_fraction == pytest.approx(costs.bubble_fraction, rel=1e-12), name
