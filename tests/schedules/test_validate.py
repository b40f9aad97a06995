"""validate: every mutation of a good timetable is caught and named, good ones pass."""

import random
import re

import pytest

from schedules import Action, Op, Schedule, ScheduleError, gpipe, one_f_one_b, validate

A = Action.parse


def _mutated(schedule, stage, edit):
    """A copy of ``schedule`` whose ``stage`` list is ``edit(list_of_actions)``."""
    order = [list(actions) for actions in schedule.order]
    order[stage] = edit(order[stage])
    return Schedule(schedule.stages, schedule.microbatches, order, schedule.placement,
                    schedule.name)


def _without(actions, text):
    return [action for action in actions if str(action) != text]


def _parse_order(lines, microbatches, placement=()):
    order = [[A(text) for text in line.split()] for line in lines]
    return Schedule(len(order), microbatches, order, placement=placement)


@pytest.mark.parametrize("generator", [gpipe, one_f_one_b])
@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (2, 5), (4, 8), (8, 3), (8, 32)])
def test_generated_schedules_are_valid(generator, stages, microbatches):
    validate(generator(stages, microbatches))


def test_validate_twice_is_cached_and_still_passes():
    schedule = one_f_one_b(4, 8)
    validate(schedule)
    validate(schedule)


def test_valid_split_backward_and_several_chunks_per_stage():
    validate(_parse_order(["F0 I0 W0", "F0@c1 I0@c1 W0@c1"], microbatches=1))
    validate(_parse_order(
        ["F0 F1 F0@c2 F1@c2 B0@c2 B1@c2 B0 B1", "F0@c1 F1@c1 F0@c3 F1@c3 B0@c3 B1@c3 B0@c1 B1@c1"],
        microbatches=2, placement=(0, 1, 0, 1),
    ))


def test_dropped_action_is_named():
    schedule = _mutated(one_f_one_b(3, 4), 1, lambda actions: _without(actions, "B3@c1"))
    with pytest.raises(ScheduleError, match=r"B3@c1 is missing from stage 1"):
        validate(schedule)


def test_duplicated_action_is_named_with_both_positions_and_the_timetable():
    schedule = _mutated(one_f_one_b(3, 4), 1, lambda actions: actions + [A("F2@c1")])
    with pytest.raises(ScheduleError) as error:
        validate(schedule)
    message = str(error.value)
    assert "F2@c1 is duplicated: stage 1 position 3 and stage 1 position 8" in message
    assert "[F2@c1]" in message  # the timetable around it, the culprit marked
    assert message.startswith("1f1b schedule:")


def test_action_on_the_wrong_stage_is_named():
    def move(order):
        order = [list(actions) for actions in order]
        order[1].remove(A("F2@c1"))
        order[2].insert(0, A("F2@c1"))
        return order

    schedule = one_f_one_b(3, 4)
    bad = Schedule(3, 4, move(schedule.order), name="1f1b")
    with pytest.raises(ScheduleError, match=r"F2@c1 is on stage 2, but chunk 1 lives on stage 1"):
        validate(bad)


def test_swapped_pair_deadlocks_and_the_cycle_is_named():
    # Stage 0 waits in B0 for stage 1's B0@c1, which comes after F1@c1,
    # which needs stage 0's F1, now queued behind B0.
    schedule = _mutated(gpipe(2, 2), 0, lambda a: [a[0], a[2], a[1], a[3]])
    assert str(schedule).splitlines()[0] == "stage 0: F0 B0 F1 B1"
    with pytest.raises(ScheduleError) as error:
        validate(schedule)
    message = str(error.value)
    assert "deadlock" in message
    cycle = _cycle_in(message)
    assert set(cycle) == {"B0", "B0@c1", "F1@c1", "F1"}
    _assert_each_waits_for_the_next(schedule, cycle)


def _cycle_in(message):
    line = next(line for line in message.splitlines() if "deadlock" in line)
    return re.findall(r"([FBIW]\d+(?:@c\d+)?) \(stage \d+\)", line)


def _waits_for(schedule, waiter, producer):
    """Independent of the library: stage order, or the data rule for F/B actions."""
    waiter, producer = A(waiter), A(producer)
    stage = schedule.placement[waiter.chunk]
    actions = schedule.order[stage]
    index = actions.index(waiter)
    if index > 0 and actions[index - 1] == producer:
        return True
    m, c = waiter.microbatch, waiter.chunk
    if waiter.op is Op.F:
        return producer == Action(Op.F, m, c - 1)
    return producer in (Action(Op.F, m, c), Action(Op.B, m, c + 1))


def _assert_each_waits_for_the_next(schedule, cycle):
    assert len(cycle) >= 2
    for waiter, producer in zip(cycle, cycle[1:] + cycle[:1]):
        assert _waits_for(schedule, waiter, producer), f"{waiter} does not wait for {producer}"


def test_deadlock_inside_a_larger_schedule():
    # On stage 1 of 1F1B, move B1@c1 ahead of F2@c1: B1@c1 needs B1@c2, which stage 2
    # runs after F2@c2, which needs F2@c1 from stage 1.
    def edit(actions):
        actions.remove(A("B1@c1"))
        actions.insert(actions.index(A("F2@c1")), A("B1@c1"))
        return actions

    schedule = _mutated(one_f_one_b(4, 8), 1, edit)
    with pytest.raises(ScheduleError, match="deadlock") as error:
        validate(schedule)
    cycle = _cycle_in(str(error.value))
    assert {"B1@c1", "B1@c2", "F2@c2", "F2@c1"} <= set(cycle)
    _assert_each_waits_for_the_next(schedule, cycle)


def test_backward_before_its_own_forward_is_a_deadlock():
    schedule = _parse_order(["B0 F0"], microbatches=1)
    with pytest.raises(ScheduleError, match="deadlock") as error:
        validate(schedule)
    assert set(_cycle_in(str(error.value))) == {"B0", "F0"}


@pytest.mark.parametrize("generator", [gpipe, one_f_one_b])
def test_random_drops_and_duplicates_are_named(generator):
    rng = random.Random(1234)
    for _ in range(40):
        schedule = generator(rng.randint(1, 6), rng.randint(1, 10))
        stage = rng.randrange(schedule.stages)
        victim = rng.choice(schedule.order[stage])

        dropped = _mutated(schedule, stage, lambda actions: [a for a in actions if a != victim])
        with pytest.raises(ScheduleError, match=rf"{victim} is missing from stage {stage}\b"):
            validate(dropped)

        at = rng.randrange(len(schedule.order[stage]) + 1)
        doubled = _mutated(schedule, stage, lambda actions: actions[:at] + [victim] + actions[at:])
        with pytest.raises(ScheduleError, match=rf"{victim} is duplicated"):
            validate(doubled)


def test_random_swaps_are_valid_or_a_real_deadlock():
    rng = random.Random(99)
    deadlocks = 0
    for _ in range(60):
        schedule = one_f_one_b(rng.randint(2, 6), rng.randint(2, 10))
        stage = rng.randrange(schedule.stages)
        i, j = sorted(rng.sample(range(len(schedule.order[stage])), 2))

        def swap(actions):
            actions[i], actions[j] = actions[j], actions[i]
            return actions

        swapped = _mutated(schedule, stage, swap)
        try:
            validate(swapped)
        except ScheduleError as error:
            deadlocks += 1
            assert "deadlock" in str(error)
            _assert_each_waits_for_the_next(swapped, _cycle_in(str(error)))
        else:
            assert not _has_cycle(swapped)
    assert deadlocks > 10


def _has_cycle(schedule):
    """Kahn's algorithm on our own edges: stage order plus the F/B data rule."""
    edges = {}
    indegree = {}
    for actions in schedule.order:
        for index, action in enumerate(actions):
            indegree.setdefault(action, 0)
            m, c = action.microbatch, action.chunk
            producers = [actions[index - 1]] if index else []
            if action.op is Op.F and c > 0:
                producers.append(Action(Op.F, m, c - 1))
            if action.op is Op.B:
                producers.append(Action(Op.F, m, c))
                if c + 1 < schedule.chunks:
                    producers.append(Action(Op.B, m, c + 1))
            for producer in producers:
                edges.setdefault(producer, []).append(action)
                indegree[action] += 1
    ready = [a for a, n in indegree.items() if n == 0]
    seen = 0
    while ready:
        node = ready.pop()
        seen += 1
        for nxt in edges.get(node, []):
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                ready.append(nxt)
    return seen != len(indegree)


@pytest.mark.parametrize(
    ("lines", "microbatches", "message"),
    [
        (["F0 F1 B0 B1", "F0@c1 F2@c1 B0@c1 B1@c1"], 2,
         r"stage 1 runs F2@c1, but micro-batches are 0..1"),
        (["F0 B0", "F0@c1 B0@c1 F0@c2"], 1, r"stage 1 runs F0@c2, but chunks are 0..1"),
        (["F0 B0 I0 W0"], 1, r"micro-batch 0 of chunk 0 has both a full backward B and a split"),
        (["F0 I0"], 1, r"W0 is missing from stage 0"),
        (["F0 W0"], 1, r"I0 is missing from stage 0"),
        (["B0"], 1, r"F0 is missing from stage 0"),
        (["F0 F1 B0", "F0@c1 F1@c1 B0@c1 B1@c1"], 2, r"B1 is missing from stage 0"),
    ],
)
def test_malformed_schedules_are_named(lines, microbatches, message):
    with pytest.raises(ScheduleError, match=message):
        validate(_parse_order(lines, microbatches))


def test_split_backward_mutations():
    good = ["F0 F1 I0 I1 W0 W1", "F0@c1 I0@c1 F1@c1 I1@c1 W1@c1 W0@c1"]
    validate(_parse_order(good, microbatches=2))
    # W before its own I waits forever.
    bad = ["F0 F1 I0 I1 W0 W1", "F0@c1 W0@c1 I0@c1 F1@c1 I1@c1 W1@c1"]
    with pytest.raises(ScheduleError, match="deadlock") as error:
        validate(_parse_order(bad, microbatches=2))
    assert {"W0@c1", "I0@c1"} <= set(_cycle_in(str(error.value)))


def test_missing_action_window_shows_where_it_belongs_and_marks_no_innocent_action():
    schedule = _mutated(one_f_one_b(3, 40), 1, lambda actions: _without(actions, "B30@c1"))
    with pytest.raises(ScheduleError, match="B30@c1 is missing from stage 1") as error:
        validate(schedule)
    window = str(error.value).splitlines()[1:]
    marked = re.findall(r"\[([^\]]+)\]", "\n".join(window))
    assert set(marked) <= {"B30@c1"}, f"present actions marked as the culprit: {marked}"
    stage_1 = next(line for line in window if line.startswith("stage 1:"))
    assert "B29@c1" in stage_1  # the neighbourhood B30@c1 was dropped from


def test_missing_forward_of_microbatch_zero_is_named():
    # The window looks for "the same op of the previous micro-batch": there is none for 0.
    with pytest.raises(ScheduleError, match=r"F0@c1 is missing from stage 1"):
        validate(_parse_order(["F0 B0", "B0@c1"], microbatches=1))
