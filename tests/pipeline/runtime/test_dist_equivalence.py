"""One stage per gloo process: loss and gradients equal the unpipelined model's, every schedule."""

from __future__ import annotations

from typing import Any

import pytest

from dist_harness import in_turn, run_ranks
from dist_workers import MODES, SCHEDULES, equivalence, timeline_on_one_clock

TOLERANCE = 1e-10


def _check(rows_by_rank: list[list[tuple]], world: int) -> None:
    for rank, rows in enumerate(rows_by_rank):
        for schedule, mode, chunks, loss_error, grad_error, compared in rows:
            where = f"rank {rank}, {schedule}, checkpoint={mode}, chunks={chunks}"
            assert loss_error < TOLERANCE, where
            assert grad_error < TOLERANCE, where
            assert compared > 0, f"{where}: no local gradients"
    # The loss rides the backward messages to every rank: the same float everywhere.
    for index in range(len(rows_by_rank[0])):
        errors = {rows[index][3] for rows in rows_by_rank}
        assert len(errors) == 1, f"{rows_by_rank[0][index][:3]}: losses differ across ranks"
    total = sum(rows_by_rank[rank][0][5] for rank in range(world))
    assert total == 16, "every layer's weight and bias is checked on exactly one rank"


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """One spawn of 2 ranks for both 2-rank tests (each spawn costs seconds), in turn."""
    calls = {"equivalence": (equivalence, (SCHEDULES, (3, 4))),
             "timeline": (timeline_on_one_clock, ())}
    return [dict(zip(calls, results)) for results in run_ranks(in_turn, 2, list(calls.values()))]


def test_two_ranks_every_schedule_and_mode(two_ranks: list[dict[str, Any]]) -> None:
    rows = [found["equivalence"] for found in two_ranks]
    assert len(rows[0]) == len(SCHEDULES) * len(MODES) * 2
    _check(rows, 2)


def test_four_ranks_every_schedule_and_mode() -> None:
    rows = run_ranks(equivalence, 4, SCHEDULES, (5,))
    _check(rows, 4)


def test_measured_timeline_is_on_one_clock(two_ranks: list[dict[str, Any]]) -> None:
    results = [found["timeline"] for found in two_ranks]
    orders_match, slack, events, bubble = results[0]
    assert results[1] is True  # only rank 0 holds the gathered timeline
    assert orders_match
    assert events == 2 * 2 * 4
    # A consumer never starts before its producer ended, give or take the clock alignment.
    assert slack > -2e-3
    assert 0.0 < bubble < 1.0


def test_single_rank_group() -> None:
    rows = run_ranks(equivalence, 1, ("1f1b",), (3,))
    for row in rows[0]:
        assert row[3] < TOLERANCE and row[4] < TOLERANCE
