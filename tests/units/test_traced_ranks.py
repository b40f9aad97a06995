"""A model as it is written, one stage per gloo rank: exact against the plain model, and its
state gathered under the model's own keys."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from tests.pipeline.helpers.dist_harness import run_ranks
from traced_models import build
from traced_workers import (exact_on_ranks, lengths_on_ranks, one_token_on_ranks, save_on_ranks,
                            state_on_ranks)

TOLERANCE = 1e-10
KINDS = ["llama", "gpt2", "looped"]
SCHEDULES = ["1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v"]
MODES = ["never", "always"]


def _in_turn(rank: int, world: int, directory: str) -> list[Any]:
    return [exact_on_ranks(rank, world, KINDS, SCHEDULES, MODES), state_on_ranks(rank, world),
            exact_on_ranks(rank, world, ["llama"], ["zb-v"], ["always"], "ordered"),
            lengths_on_ranks(rank, world, [12, 7, 20]), save_on_ranks(rank, world, directory),
            one_token_on_ranks(rank, world)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traced") / "checkpoint"


@pytest.fixture(scope="module")
def two_ranks(saved: Path) -> list[list[Any]]:
    """One spawn for every test here (a spawn, torch's and transformers' imports and the
    traces cost seconds)."""
    return run_ranks(_in_turn, 2, str(saved))


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


def test_a_one_token_sequence_is_traced_again_on_every_rank(two_ranks: list[list[Any]]
                                                            ) -> None:
    for rank, found in enumerate(two_ranks):
        loss_error, grad_error = found[5]
        assert loss_error < TOLERANCE and grad_error < TOLERANCE, rank


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


def test_a_checkpoint_saved_on_two_ranks_loads_into_the_plain_model(
        two_ranks: list[list[Any]], saved: Path) -> None:
    import torch

    from pipeline import load_into_model
    from traced_models import reference

    keys_0, keys_1 = (found[4] for found in two_ranks)
    model, batch, target = build("llama")
    assert set(keys_0) | set(keys_1) == set(model.state_dict())
    trained = copy.deepcopy(model)
    trained_optimizer = torch.optim.Adam(trained.parameters(), lr=0.01)
    for _ in range(2):
        reference(trained, batch, target, "llama")
        trained_optimizer.step()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    assert load_into_model(model, optimizer, saved) == 2
    state = trained.state_dict()
    assert max((value - state[key]).abs().max().item()
               for key, value in model.state_dict().items()) < TOLERANCE
    for (_, mine), (_, expected) in zip(sorted(optimizer.state_dict()["state"].items()),
                                        sorted(trained_optimizer.state_dict()["state"].items())):
        assert (mine["exp_avg_sq"] - expected["exp_avg_sq"]).abs().max().item() < TOLERANCE
