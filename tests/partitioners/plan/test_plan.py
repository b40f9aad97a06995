"""partitioners.plan against brute force: every candidate simulated, the fastest that fits picked."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import combinations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioners import LayerCost, LossCost, MemoryLimitError, Profile
from partitioners.plan.search import Candidate, Plan, plan
from partitioners.plan.costs import (
    candidate_costs,
    chunk_sums,
    linear_costs,
    makespan_lower_bound,
    microbatch_scale,
    recomputed_flags,
)
from partitioners.plan.cuts import cut_memory, memory_capped_cut, time_cut
from partitioners.plan.space import default_microbatch_counts, variants
from schedules import Costs as ScheduleCosts
from schedules import Link, get_schedule, schedule_info, schedule_names, simulate

Costs = Callable[[int], Sequence[LayerCost]]


def brute_force(
    costs: Costs, stages: int, batch: int, limit: float | None, hop: float = 0.0,
) -> list[tuple[float, float, str]]:
    """(makespan, peak, description) of every candidate, each simulated; no pruning.

    The candidates ``plan`` defines, written out plainly: per schedule variant,
    micro-batch count and checkpoint mode, the time cut; and, under a limit that
    it does not fit, for one chunk per stage, the memory-capped cut.
    """
    found = []
    for m in default_microbatch_counts(stages, batch):
        layers = costs(-(-batch // m))
        scale = microbatch_scale(batch, m)
        for name in schedule_names():
            info = schedule_info(name)
            for options in variants(name, stages, m):
                chunks = stages * info.chunks(**dict(options))
                if chunks > len(layers):
                    continue
                schedule = get_schedule(name, stages, m, **dict(options))
                fastest = time_cut(layers, chunks)  # the same for every mode
                for mode in ("never", "except_last", "always"):
                    cut = fastest
                    while True:
                        timeline = simulate(schedule, costs=candidate_costs(
                            chunk_sums(layers, cut), scale, mode, hop))
                        peak = max(timeline.peak_bytes or (0.0,))
                        found.append((timeline.makespan, peak, f"{name} {dict(options)} M={m} "
                                      f"{list(cut)} {mode}"))
                        if limit is None or peak <= limit or chunks != stages:
                            break
                        held = info.memory(stages, m, **dict(options))
                        capped = memory_capped_cut(layers, held, limit, checkpoint=mode)
                        if capped == cut:
                            break
                        cut = capped
    return found


@st.composite
def cases(draw: st.DrawFn) -> tuple[Costs, int, int]:
    stages = draw(st.integers(2, 3))
    layers = draw(st.integers(2 * stages, 2 * stages + 3))
    batch = draw(st.integers(stages, 9))
    seconds = st.integers(1, 9).map(float)
    measured = [
        LayerCost(forward=draw(seconds), backward=draw(seconds), param_bytes=draw(st.integers(0, 50)),
                  activation_bytes=draw(st.integers(0, 40)), saved_bytes=draw(st.integers(0, 60)),
                  backward_input=draw(seconds), backward_weight=draw(seconds))
        for _ in range(layers)
    ]
    loss = draw(st.none() | st.builds(LossCost, seconds, seconds))
    return linear_costs(Profile(measured, loss=loss), rows=1), stages, batch


FAST = settings(max_examples=15, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FAST
@given(case=cases(), fraction=st.sampled_from([None, 0.3, 0.6, 0.9]))
def test_the_pick_is_the_fastest_that_fits(case: tuple[Costs, int, int],
                                           fraction: float | None) -> None:
    costs, stages, batch = case
    everything = brute_force(costs, stages, batch, None)
    peaks = sorted(peak for _, peak, _ in everything)
    limit = None if fraction is None else peaks[int(fraction * (len(peaks) - 1))]
    found = brute_force(costs, stages, batch, limit) if limit is not None else everything
    fitting = [(t, p, d) for t, p, d in found if limit is None or p <= limit]
    best = min(fitting)
    chosen = plan(costs, stages, batch, memory_limit=limit)
    assert chosen.step_time == best[0], (chosen.describe(), best)
    assert limit is None or max(chosen.peak_memory) <= limit
    exhaustive = plan(costs, stages, batch, memory_limit=limit, prune=False)
    assert exhaustive.describe() == chosen.describe()
    assert exhaustive.step_time == chosen.step_time
    # Every candidate is marked by whether it fits, and those that do come first.
    for candidate in exhaustive.candidates:
        assert candidate.fits == (limit is None or max(candidate.peak_memory) <= limit)
    flags = [candidate.fits for candidate in exhaustive.candidates]
    assert flags == sorted(flags, reverse=True)
    assert exhaustive.candidates[0].describe() == exhaustive.describe()


@FAST
@given(case=cases())
def test_an_impossible_limit_names_the_smallest_that_fits(case: tuple[Costs, int, int]) -> None:
    costs, stages, batch = case
    smallest = min(peak for _, peak, _ in brute_force(costs, stages, batch, 0.0))
    if smallest < 1:
        return  # nothing is held: every limit fits
    with pytest.raises(MemoryLimitError, match="the smallest limit that fits is") as error:
        plan(costs, stages, batch, memory_limit=smallest - 0.5)
    named = int(re.search(r"\((\d+) bytes\)", str(error.value)).group(1))
    assert named == math.ceil(smallest) == error.value.smallest_limit
    fitted = plan(costs, stages, batch, memory_limit=named)
    assert max(fitted.peak_memory) <= named


def test_the_bound_never_exceeds_the_simulated_makespan() -> None:
    layers = [LayerCost(forward=1.0 + i % 3, backward=2.0 + i % 2, activation_bytes=8,
                        backward_input=1.5, backward_weight=1.0) for i in range(12)]
    hop = Link(latency=0.5, bandwidth=4.0)
    for name in schedule_names():
        info = schedule_info(name)
        for m in (4, 7, 8):
            for options in variants(name, 3, m):
                schedule = get_schedule(name, 3, m, **dict(options))
                cut = time_cut(layers, schedule.chunks)
                scale = microbatch_scale(22, m) or (1.0,) * m
                for mode in ("never", "always"):
                    sums = chunk_sums(layers, cut)
                    bound = makespan_lower_bound(sums, schedule.placement, info.split_backward,
                                                 scale, recomputed_flags(mode, m), hop)
                    timeline = simulate(schedule, costs=candidate_costs(
                        sums, microbatch_scale(22, m), mode, hop))
                    assert bound <= timeline.makespan * (1 + 1e-12), (name, m, mode)


def test_uneven_microbatches_are_scaled_by_rows() -> None:
    layers = [LayerCost(forward=1.0, backward=2.0, saved_bytes=10, activation_bytes=4)] * 6
    chosen = plan(linear_costs(layers, rows=1), stages=2, batch=10, microbatch_counts=[4],
                  schedules=["1f1b"], checkpoints=["never"])
    assert chosen.microbatches == 4 and chosen.balance == (3, 3)
    # 10 rows into 4: 3, 3, 2, 2 rows; costs measured at 3 rows, the last two scaled by 2/3.
    expected = simulate(get_schedule("1f1b", 2, 4), costs=candidate_costs(
        chunk_sums(linear_costs(layers, 1)(3), (3, 3)), (1.0, 1.0, 2 / 3, 2 / 3), "never"))
    assert chosen.step_time == pytest.approx(expected.makespan)
    assert chosen.step_time < simulate(get_schedule("1f1b", 2, 4), costs=candidate_costs(
        chunk_sums(linear_costs(layers, 1)(3), (3, 3)), (), "never")).makespan
    assert microbatch_scale(10, 4) == (1.0, 1.0, 2 / 3, 2 / 3)


def test_every_registered_schedule_is_a_candidate() -> None:
    layers = [LayerCost(forward=1.0, backward=2.0, saved_bytes=10)] * 12
    chosen = plan(linear_costs(layers, 1), stages=3, batch=24, prune=False)
    names = {candidate.schedule for candidate in chosen.candidates}
    assert names == set(schedule_names())
    assert {"max_inflight"} <= {key for c in chosen.candidates for key in c.schedule_options}
    # Honours min_microbatches: dualpipe-v needs M >= 2P.
    assert all(c.microbatches >= 6 for c in chosen.candidates if c.schedule == "dualpipe-v")


def test_a_plan_carries_what_pipe_needs() -> None:
    layers = [LayerCost(forward=1.0, backward=2.0, saved_bytes=10)] * 8
    chosen = plan({2: layers, 4: layers}, stages=2, batch=8, schedules=["1f1b", "interleaved-1f1b"],
                  checkpoints="always")
    assert isinstance(chosen, Plan) and isinstance(chosen.candidates[0], Candidate)
    options = chosen.pipe_options()
    assert set(options) == {"chunks", "balance", "schedule", "schedule_options", "checkpoint"}
    assert sum(options["balance"]) == 8 and options["checkpoint"] == "always"
    assert {c.microbatches for c in chosen.candidates} <= {2, 4}
    with pytest.raises(AttributeError):
        chosen.microbatches = 3  # type: ignore[misc]


def test_the_memory_capped_cut_is_never_under_the_simulated_peak() -> None:
    layers = [LayerCost(forward=1.0, backward=2.0, param_bytes=p, activation_bytes=a, saved_bytes=s)
              for p, a, s in [(5, 30, 2), (1, 2, 40), (9, 8, 8), (3, 50, 1), (2, 4, 20), (1, 1, 1)]]
    for name in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
        held = schedule_info(name).memory(3, 5)
        cut = memory_capped_cut(layers, held, 100.0)
        for mode in ("never", "except_last", "always"):
            timeline = simulate(get_schedule(name, 3, 5), costs=candidate_costs(
                chunk_sums(layers, cut), (), mode))
            linear = cut_memory(layers, cut, held)
            assert all(p <= q for p, q in zip(timeline.peak_bytes, linear)), (name, mode)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"stages": 0}, "stages: expected an int >= 1, got 0"),
    ({"batch": 0}, "batch: expected an int >= 1, got 0"),
    ({"memory_limit": -1.0}, "memory_limit: expected bytes per stage >= 0, got -1.0"),
    ({"schedules": ["nope"]}, "unknown schedule 'nope'"),
    ({"checkpoints": ["sometimes"]}, "checkpoints: expected some of never"),
    ({"microbatch_counts": [9]}, "microbatch_counts: expected ints in 1..8"),
    ({"microbatch_counts": [3]}, "costs are given for [2, 4] rows only"),
])
def test_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    layers = [LayerCost(forward=1.0, backward=2.0)] * 4
    arguments: dict[str, object] = {"costs": {2: layers, 4: layers}, "stages": 2, "batch": 8}
    arguments.update(kwargs)
    with pytest.raises(ValueError) as error:
        plan(**arguments)  # type: ignore[arg-type]
    assert message in str(error.value)


def test_costs_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match="costs: expected a mapping"):
        plan([LayerCost(forward=1.0, backward=2.0)] * 4, stages=2, batch=8)  # type: ignore[arg-type]


def test_the_runtimes_overhead_is_added_to_every_action() -> None:
    layers = linear_costs([LayerCost(forward=1.0, backward=2.0, saved_bytes=10)] * 4, rows=1)
    bare = plan(layers, stages=2, batch=4, schedules=["gpipe"], microbatch_counts=[4],
                checkpoints=["never"])
    paid = plan(layers, stages=2, batch=4, schedules=["gpipe"], microbatch_counts=[4],
                checkpoints=["never"], action_overhead=0.25)
    schedule = get_schedule("gpipe", stages=2, microbatches=4)
    # Each stage's chunk: 2 layers, F = 2 + 0.25, B = 4 + 0.25, at one row per micro-batch.
    expected = simulate(schedule, costs=ScheduleCosts(forward=[2.25, 2.25],
                                                    backward=[4.25, 4.25]))
    assert paid.step_time == pytest.approx(expected.makespan)
    assert paid.step_time > bare.step_time
    with pytest.raises(ValueError, match="action_overhead"):
        plan(layers, stages=2, batch=4, action_overhead=-1.0)


def test_the_memory_cut_counts_what_recomputation_drops() -> None:
    # The first two layers save 300 bytes a micro-batch, and every layer passes on only 10:
    # recomputed, a held micro-batch keeps just its stage's input.
    layers = [LayerCost(forward=1.0, backward=2.0, saved_bytes=300 if i < 2 else 10,
                        activation_bytes=10) for i in range(6)]
    held = schedule_info("1f1b").memory(2, 4)  # 2 and 1 micro-batches
    limit = 450.0
    kept_whole = memory_capped_cut(layers, held, limit, checkpoint="never")
    assert max(cut_memory(layers, kept_whole, held)) > limit  # nothing fits without recomputing
    recomputed = memory_capped_cut(layers, held, limit, checkpoint="always")
    assert max(cut_memory(layers, recomputed, held, checkpoint="always")) <= limit
    timeline = simulate(get_schedule("1f1b", 2, 4), costs=candidate_costs(
        chunk_sums(layers, recomputed), (), "always"))
    assert max(timeline.peak_bytes) <= limit  # the linear model never under-estimates
    chosen = plan(linear_costs(layers, rows=1), stages=2, batch=4, memory_limit=limit,
                  schedules=["1f1b"], microbatch_counts=[4], checkpoints=["always"])
    assert max(chosen.peak_memory) <= limit


def test_the_memory_capped_cut_charges_tied_copies_and_is_the_fastest_that_fits() -> None:
    # A head tied to the embedding: a stage holding layer 5 but not layer 0 holds its own
    # copy of 60 bytes (120 with its gradient). Without it, [2, 2, 2], the fastest cut,
    # would seem to fit.
    layers = [LayerCost(forward=f, backward=2 * f, param_bytes=p, activation_bytes=4,
                        saved_bytes=s, tied=((0, 60),) if i == 5 else ())
              for i, (f, p, s) in enumerate([(2, 60, 8), (3, 5, 10), (2, 9, 6), (4, 1, 9),
                                             (1, 2, 5), (2, 60, 3)])]
    untied = [replace(cost, tied=()) for cost in layers]
    for name, limit in [("1f1b", 250.0), ("gpipe", 260.0), ("zb-h1", 255.0)]:
        held = schedule_info(name).memory(3, 4)
        assert (cut_memory(layers, (2, 2, 2), held)[2]
                == cut_memory(untied, (2, 2, 2), held)[2] + 120 > limit)
        slowest = {}
        for first, second in combinations(range(1, 6), 2):
            cut = (first, second - first, 6 - second)
            if max(cut_memory(layers, cut, held)) <= limit:
                ends = (0, first, second, 6)
                slowest[cut] = max(sum(layer.time for layer in layers[a:b])
                                   for a, b in zip(ends, ends[1:]))
        chosen = memory_capped_cut(layers, held, limit)
        assert chosen in slowest and slowest[chosen] == min(slowest.values()), name
        timeline = simulate(get_schedule(name, 3, 4), costs=candidate_costs(
            chunk_sums(layers, chosen), (), "never", placement=(0, 1, 2)))
        assert all(p <= q for p, q in zip(timeline.peak_bytes, cut_memory(layers, chosen, held)))
