"""Shared modules anywhere, on 2 gloo ranks: one block instance at six positions across both
ranks trains exactly and is never re-initialised; a state that would break a tie is refused
naming both keys; strict loading decides alike on every rank."""

from __future__ import annotations

import pytest

import shared_workers
from dist_harness import run_ranks

TOLERANCE = 1e-10


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-v"])
def test_one_block_at_six_positions_across_ranks(schedule: str) -> None:
    for loss_error, grad_error, changed in run_ranks(
            shared_workers.shared_block_across_ranks, 2, schedule):
        assert changed == 0.0  # never re-initialised
        assert loss_error < TOLERANCE and grad_error < TOLERANCE, (loss_error, grad_error)


def test_a_state_that_breaks_a_tie_is_refused_on_every_rank_naming_both_keys() -> None:
    for message in run_ranks(shared_workers.tie_breaking_state, 2):
        assert "'0.weight' and '3.weight' are one parameter" in message


def test_strict_loading_raises_on_every_rank_where_a_key_is_missing() -> None:
    for message in run_ranks(shared_workers.missing_key_everywhere, 2):
        assert "missing ['2.bias']" in message


def test_a_rank_loads_back_its_own_state_strictly() -> None:
    assert run_ranks(shared_workers.own_state_roundtrip, 2) == ["loaded", "loaded"]


def test_strict_loading_raises_on_every_rank_where_a_key_is_unknown() -> None:
    for message in run_ranks(shared_workers.unknown_key_everywhere, 2):
        assert "unexpected ['2.scale']" in message
