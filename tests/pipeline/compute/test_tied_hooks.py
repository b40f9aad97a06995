"""Post-accumulate hooks on a weight tied across stages run as in the plain model: once per
micro-batch, on the gradient summed over both uses (they ran once per stage, on partial
sums), in one process and on ranks; tied across ranks, they are refused before any
gradient changes."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

import tied_hooks_workers as workers
from dist_harness import in_turn, run_ranks
from pipeline import Pipe

TOLERANCE = 1e-10


@pytest.mark.parametrize("schedule, balance", [
    ("1f1b", [2, 2]), ("gpipe", [2, 2]), ("zb-h1", [2, 2]), ("zb-v", [2, 2, 2, 2]),
    ("interleaved-1f1b", [2, 2, 2, 2]),
])
@pytest.mark.parametrize("forget", [False, True])
def test_a_tied_weights_hooks_run_once_per_microbatch_on_the_summed_gradient(
        schedule: str, balance: list[int], forget: bool) -> None:
    model = workers.tied(sum(balance))
    expected, expected_grad = workers.plain(model, forget)
    seen = workers.record(model[0].weight, forget)
    pipe = Pipe(model, workers.MICROBATCHES, balance=balance, devices=["cpu", "cpu"],
                schedule=schedule, loss_fn=nn.CrossEntropyLoss(), checkpoint="never")
    pipe.step(*workers.batch())
    assert len(seen) == workers.MICROBATCHES
    assert workers.difference(seen, expected) < TOLERANCE
    if forget:
        assert model[0].weight.grad is None and expected_grad is None
    else:
        assert float((model[0].weight.grad - expected_grad).abs().max()) < TOLERANCE


def test_the_users_hooks_are_back_after_the_step_and_a_second_step_accumulates() -> None:
    model = workers.tied()
    seen = workers.record(model[0].weight)
    hooks = model[0].weight._post_accumulate_grad_hooks
    pipe = Pipe(model, workers.MICROBATCHES, balance=[2, 2], devices=["cpu", "cpu"],
                schedule="1f1b", loss_fn=nn.CrossEntropyLoss())
    pipe.step(*workers.batch())
    first = model[0].weight.grad.clone()
    assert model[0].weight._post_accumulate_grad_hooks is hooks
    pipe.step(*workers.batch())
    assert len(seen) == 2 * workers.MICROBATCHES
    assert float((model[0].weight.grad - 2 * first).abs().max()) < TOLERANCE


@pytest.fixture(scope="module")
def on_ranks() -> list[dict[str, Any]]:
    """One spawn of 2 gloo ranks for the tests below."""
    calls = {"one_rank": (workers.hooks_on_one_rank, ()),
             "across": (workers.hooks_across_ranks, ())}
    return [dict(zip(calls, results))
            for results in run_ranks(in_turn, 2, list(calls.values()), timeout=240)]


def test_hooks_on_a_weight_tied_within_a_rank_run_once_per_microbatch(
        on_ranks: list[dict[str, Any]]) -> None:
    for hooks_error, grad_error in (found["one_rank"] for found in on_ranks):
        assert hooks_error < TOLERANCE and grad_error < TOLERANCE, (hooks_error, grad_error)


def test_hooks_on_a_weight_tied_across_ranks_are_refused_before_any_gradient(
        on_ranks: list[dict[str, Any]]) -> None:
    for said, untouched in (found["across"] for found in on_ranks):
        assert "tied across stages on different ranks" in said, said
        assert "'0.weight'" in said or "'3.weight'" in said, said
        assert untouched
