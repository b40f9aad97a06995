"""Timelines cross ranks when they are asked for, not every step (issue 43): real gloo ranks,
the gathers counted on each rank's runner (``StepTimes.gathers``)."""

from __future__ import annotations

from typing import Any

import pytest

from dist_harness import in_turn, run_ranks
from timeline_workers import (PAUSE, STEPS, predict_then_read, read_by_rank_zero_before_close,
                              read_once_on_every_rank)


@pytest.fixture(scope="module")
def two_ranks() -> list[list[Any]]:
    calls = [(read_once_on_every_rank, ()), (read_by_rank_zero_before_close, ()),
             (predict_then_read, ())]
    return run_ranks(in_turn, 2, calls)


def _whole_and_last(facts: dict[str, Any] | None) -> None:
    """Every rank's events, all of them, and the last step's (its forwards on stage 1 slept)."""
    assert facts is not None
    assert facts["stages"] == [0, 1]
    assert facts["events"] == facts["expected"]
    assert facts["slowest_forward"] >= PAUSE * 0.9


def test_a_hundred_steps_read_once_gather_once(two_ranks: list[list[Any]]) -> None:
    for rank, ranks in enumerate(two_ranks):
        found = ranks[0]
        assert (found["before"], found["read"], found["closed"]) == (0, 1, 1), (rank, found)
        assert found["same"]
    _whole_and_last(two_ranks[0][0]["timeline"])
    assert two_ranks[1][0]["timeline"] is None  # the other ranks keep none


def test_rank_zero_reads_alone_before_close_and_the_others_send_in_close(
        two_ranks: list[list[Any]]) -> None:
    assert [ranks[1]["gathers"] for ranks in two_ranks] == [1, 1]
    _whole_and_last(two_ranks[0][1]["timeline"])
    _whole_and_last(two_ranks[0][1]["after_close"])


def test_predict_gathers_the_recent_steps_and_a_read_after_it_gathers_nothing(
        two_ranks: list[list[Any]]) -> None:
    for rank, ranks in enumerate(two_ranks):
        found = ranks[2]
        assert (found["before"], found["predicted"], found["read"]) == (0, 1, 1), (rank, found)
        assert found["closed"] == 2  # the step after it, sent at close
        assert found["recent_before"] == 0
    first = two_ranks[0][2]
    assert first["kept"] == first["recent_steps"]  # rank 0 keeps the recent steps only
    assert two_ranks[1][2]["kept"] == 0
    facts = first["timeline"]
    assert facts is not None and facts["stages"] == [0, 1]
    assert facts["events"] == facts["expected"]


def test_steps_alone_gather_nothing_in_one_step() -> None:
    """One process: nothing crosses; the timeline is the step's, as before."""
    import torch
    from torch import nn

    from pipeline import Pipe

    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=2, balance=[1, 1],
                devices=["cpu", "cpu"], loss_fn=nn.MSELoss())
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    for _ in range(STEPS // 10):
        pipe.step(x, y)
    assert len(pipe._runner.recent_timelines()) == 5
    assert pipe.timeline is pipe._runner.recent_timelines()[-1]
