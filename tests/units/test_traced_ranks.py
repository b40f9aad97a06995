"""A model as it is written, one stage per gloo rank: exact against the plain model, and its
state gathered under the model's own keys."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.group.launch import run_ranks
from traced_models import build
from traced_workers import exact_on_ranks, lengths_on_ranks, state_on_ranks

TOLERANCE = 1e-10
KINDS = ["llama", "gpt2", "looped"]
SCHEDULES = ["1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v"]
MODES = ["never", "always"]


def _in_turn(rank: int, world: int) -> list[Any]:
    return [exact_on_ranks(rank, world, KINDS, SCHEDULES, MODES), state_on_ranks(rank, world),
            exact_on_ranks(rank, world, ["llama"], ["zb-v"], ["always"], "ordered"),
            lengths_on_ranks(rank, world, [12, 7, 20])]


@pytest.fixture(scope="module")
def two_ranks() -> list[list[Any]]:
    """One spawn for both tests (a spawn, torch's and transformers' imports cost seconds)."""
    return run_ranks(_in_turn, 2)


def test_two_ranks_every_model_schedule_and_mode(two_ranks: list[list[Any]]) -> None:
    by_rank = [found[0] for found in two_ranks]
    assert len(by_rank[0]) == len(KINDS) * len(SCHEDULES) * len(MODES)
    for rank, rows in enumerate(by_rank):
        for kind, schedule, mode, loss_error, grad_error, compared in rows:
            where = f"rank {rank}: {kind}, {schedule}, checkpoint={mode}"
            assert loss_error < TOLERANCE, where
            assert grad_error < TOLERANCE, where
            assert compared > 0, where


def test_the_transport_under_nccls_rules(two_ranks: list[list[Any]]) -> None:
    for rank, found in enumerate(two_ranks):
        (kind, schedule, mode, loss_error, grad_error, compared), = found[2]
        assert loss_error < TOLERANCE and grad_error < TOLERANCE and compared > 0, rank


def test_sequence_length_changes_between_steps_on_ranks(two_ranks: list[list[Any]]) -> None:
    for rank, found in enumerate(two_ranks):
        assert len(found[3]) == 3
        for loss_error, grad_error in found[3]:
            assert loss_error < TOLERANCE and grad_error < TOLERANCE, rank


def test_gathered_state_is_the_plain_models_under_its_own_keys(two_ranks: list[list[Any]]
                                                               ) -> None:
    (keys_0, gathered, worst, loaded), (keys_1, *nothing) = [found[1] for found in two_ranks]
    plain, _, _ = build("llama")
    expected = set(plain.state_dict())
    assert nothing == [None, None, None]
    assert set(gathered) == expected
    assert set(keys_0) | set(keys_1) == expected
    assert not set(keys_0) >= expected and not set(keys_1) >= expected  # each holds its share
    assert worst < TOLERANCE
    assert loaded
