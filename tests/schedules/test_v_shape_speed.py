"""The V replay's ready heaps and counters (issue 43) choose exactly what a plain scan chooses."""

import pytest

from schedules.action import Action, Op, Schedule
from schedules.dependencies import dependency_keys
from schedules.v_replay import CappedReplay, ReplayPlan, Stalled
from schedules.v_shape import SPINES, _critical_order, v_memory_cap


def _scanned(critical, cap, window, room):
    """The replay's rule read literally: every step, each stage scans its list for ready actions."""
    stages = critical.stages
    lists = [list(actions) for actions in critical.order]
    done = {}  # (op, microbatch, chunk) -> the step after it ran
    held, pending, orders = [0] * stages, [[] for _ in range(stages)], [[] for _ in range(stages)]

    def ready(action, step):
        keys = dependency_keys(critical, action.op, action.microbatch, action.chunk)
        return all(done.get(key, step + 1) <= step for key in keys)

    def fits(stage, action):
        need = (2 if room else 1) if action.chunk == stage else 1
        return action.op is not Op.F or held[stage] + need <= cap

    def choose(stage, step):
        for index, action in enumerate(lists[stage][:window]):
            if ready(action, step):
                if fits(stage, action):
                    return lists[stage].pop(index)
                if index == 0 and pending[stage]:
                    break
        return pending[stage].pop(0) if pending[stage] else None

    def any_ready(stage, step):
        for index, action in enumerate(lists[stage]):
            if ready(action, step) and fits(stage, action):
                return lists[stage].pop(index)
        return None

    step = 0
    while any(lists) or any(pending):
        ran = [choose(stage, step) for stage in range(stages)]
        if all(action is None for action in ran):
            ran = [any_ready(stage, step) for stage in range(stages)]
        if all(action is None for action in ran):
            return "stalled", step
        for stage, action in enumerate(ran):
            if action is not None:
                orders[stage].append(action)
                done[(action.op, action.microbatch, action.chunk)] = step + 1
                held[stage] += {Op.F: 1, Op.I: 0, Op.W: -1}[action.op]
                if action.op is Op.I:
                    pending[stage].append(Action(Op.W, action.microbatch, action.chunk))
        step += 1
    return step, tuple(tuple(actions) for actions in orders)


@pytest.mark.parametrize("variant", ["v-half", "v-min"])
def test_every_replay_equals_the_plain_scan(variant):
    for stages in range(1, 9):
        placement = tuple(min(chunk, 2 * stages - 1 - chunk) for chunk in range(2 * stages))
        cap = 2 * v_memory_cap(variant, stages)
        for microbatches in sorted({1, 2, stages, 2 * stages + 1, 4 * stages}):
            for spine, gap, replays in SPINES:
                order = tuple(_critical_order(spine, stages, stage, microbatches, gap)
                              for stage in range(stages))
                critical = Schedule(stages, microbatches, order, placement, name=variant)
                plan = ReplayPlan(critical)
                for window, room in replays:
                    try:
                        fast = CappedReplay(plan, cap, window, room).run()
                    except Stalled as stalled:
                        fast = ("stalled", stalled.args[0])
                    expected = _scanned(critical, cap, window, room)
                    assert fast == expected, (stages, microbatches, spine, gap, window, room)
