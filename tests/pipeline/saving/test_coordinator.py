"""The first rank's answer to each rank (``format.shares_plain`` / ``share_from_plain``): a rank
learns only which of its own items it writes, checked before it is used."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from pipeline.saving.format import CheckpointError, share_from_plain, shares_plain


def _local_plan(state: dict[str, torch.Tensor]) -> SavePlan:
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict=state, storage_meta=None, is_coordinator=False)
    plan: SavePlan = planner.create_local_plan()
    return plan


def test_replicas_duplicates_are_written_once_and_each_rank_learns_its_positions() -> None:
    shared = torch.ones(4)
    plans = [_local_plan({"a": torch.zeros(3), "shared": shared}),
             _local_plan({"shared": shared, "b": torch.zeros(2)})]
    coordinator = DefaultSavePlanner()
    coordinator.set_up_planner(state_dict={}, storage_meta=None, is_coordinator=True)
    merged, _ = coordinator.create_global_plan(plans)
    shares = shares_plain(plans, merged)
    written = [[plans[r].items[p].index.fqn for p, _ in share_from_plain(share, 2, "share")]
               for r, share in enumerate(shares)]
    assert sorted(sum(written, [])) == ["a", "b", "shared"]  # "shared" once
    assert all(hint == 0 for share in shares for hint in share["hints"])


@pytest.mark.parametrize("share, message", [
    ({"kept": [1, 0], "hints": [0, 0]}, r"an increasing position below 2"),
    ({"kept": [2], "hints": [0]}, r"an increasing position below 2"),
    ({"kept": [0], "hints": []}, r"as many hints as positions"),
    ({"kept": [0], "hints": [-1]}, r"a non-negative int"),
    ({"kept": [0]}, r"an object with the keys kept, hints"),
])
def test_a_share_that_does_not_fit_the_rank_s_plan_is_refused(share: object, message: str
                                                               ) -> None:
    with pytest.raises(CheckpointError, match=message):
        share_from_plain(share, 2, "the save plan's share")
