"""Shared modules anywhere, on 2 gloo ranks: one block instance at six positions across both
ranks trains exactly and is never re-initialised; a state that would break a tie is refused
naming both keys; strict loading decides alike on every rank."""

from __future__ import annotations

from typing import Any

import pytest

import shared_workers
from dist_harness import in_turn, run_ranks

TOLERANCE = 1e-10


SCHEDULES = ("1f1b", "zb-h1", "zb-v")


@pytest.fixture(scope="module")
def on_ranks() -> list[dict[str, Any]]:
    """One spawn of 2 ranks for every test (each spawn costs seconds), each rank function
    in turn on its own Pipe: per rank, each result by name."""
    calls = {
        **{schedule: (shared_workers.shared_block_across_ranks, (schedule,))
           for schedule in SCHEDULES},
        "own_state": (shared_workers.own_state_roundtrip, ()),
        "tie_breaking": (shared_workers.tie_breaking_state, ()),
        "missing_key": (shared_workers.missing_key_everywhere, ()),
        "unknown_key": (shared_workers.unknown_key_everywhere, ()),
    }
    return [dict(zip(calls, results))
            for results in run_ranks(in_turn, 2, list(calls.values()), timeout=240)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_block_at_six_positions_across_ranks(
        on_ranks: list[dict[str, Any]], schedule: str) -> None:
    for loss_error, grad_error, changed in (found[schedule] for found in on_ranks):
        assert changed == 0.0  # never re-initialised
        assert loss_error < TOLERANCE and grad_error < TOLERANCE, (loss_error, grad_error)


def test_a_state_that_breaks_a_tie_is_refused_on_every_rank_naming_both_keys(
        on_ranks: list[dict[str, Any]]) -> None:
    for found in on_ranks:
        assert "'0.weight' and '3.weight' are one parameter" in found["tie_breaking"]


def test_strict_loading_raises_on_every_rank_where_a_key_is_missing(
        on_ranks: list[dict[str, Any]]) -> None:
    for found in on_ranks:
        assert "missing ['2.bias']" in found["missing_key"]


def test_a_rank_loads_back_its_own_state_strictly(on_ranks: list[dict[str, Any]]) -> None:
    assert [found["own_state"] for found in on_ranks] == ["loaded", "loaded"]


def test_strict_loading_raises_on_every_rank_where_a_key_is_unknown(
        on_ranks: list[dict[str, Any]]) -> None:
    for found in on_ranks:
        assert "unexpected ['2.scale']" in found["unknown_key"]
