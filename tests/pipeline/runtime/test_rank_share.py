"""rank_share: a rank keeps its own stage's steps, arrays only, and nothing of the others'."""

from __future__ import annotations

import gc
import types
from collections.abc import Iterator

import pytest

from schedules import Action, Group, comm_plan, forward_only, get_schedule
from schedules.action import StageOrder
from schedules.plan_steps import PlanSteps

from pipeline.runtime.rank_share import rank_share


def reachable(root: object) -> Iterator[object]:
    """Every object reachable from ``root`` through ``gc.get_referents``, classes, modules
    and functions excluded (the code, not the data)."""
    seen = {id(root)}
    stack = [root]
    while stack:
        item = stack.pop()
        yield item
        for found in gc.get_referents(item):
            if isinstance(found, (type, types.ModuleType, types.FunctionType)):
                continue
            if id(found) not in seen:
                seen.add(id(found))
                stack.append(found)


@pytest.fixture(scope="module")
def zb_v():  # type: ignore[no-untyped-def]
    return get_schedule("zb-v", 16, 64)


@pytest.mark.parametrize("stage", [0, 5, 15])
def test_a_share_holds_only_its_stages_actions(zb_v, stage: int) -> None:  # type: ignore[no-untyped-def]
    share = rank_share(zb_v, stage)
    own = zb_v.order[stage]
    chunks = set(zb_v.chunks_of_stage[stage])
    objects = list(reachable(share))
    tracked = [item for item in objects if gc.is_tracked(item)]
    # A handful of containers, not an object per action: far below the stage's own actions.
    assert len(tracked) < min(200, len(own) // 4), sorted(
        {type(item).__name__ for item in tracked})
    assert not [item for item in objects if isinstance(item, (Action, Group))]
    orders = [item for item in objects if isinstance(item, StageOrder)]
    for order in orders:
        assert set(order.chunks) <= chunks  # no other stage's action is reachable
    assert sum(len(order) for order in orders) <= 2 * len(own) + len(
        forward_only(zb_v).order[stage])


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-v", "dualpipe-v"])
def test_a_share_is_the_whole_plans_part(name: str) -> None:
    schedule = get_schedule(name, 4, 8)
    training, forward = comm_plan(schedule), comm_plan(forward_only(schedule))
    for stage in range(schedule.stages):
        share = rank_share(schedule, stage)
        assert share.training.steps == training.stages[stage]
        assert share.forward.steps == forward.stages[stage]
        assert share.training.comm.sends(stage) == training.sends(stage)
        assert share.training.comm.receives(stage) == training.receives(stage)
        assert share.forward.comm.receives(stage) == forward.receives(stage)
        assert set(share.channels) == set(training.channels) | set(forward.channels)
        assert isinstance(share.training.steps, PlanSteps)


def test_a_stage_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="stage: expected an int in 0..3, got 4"):
        rank_share(get_schedule("1f1b", 4, 8), 4)
