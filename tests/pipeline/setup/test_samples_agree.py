"""Ranks tracing a model with samples that disagree are told so at Pipe(), each rank's named
(issue 39, item 7): before, rows 4 against 6 or another key failed on some ranks with errors
that did not name the cause, or hung until the timeout."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from dist_harness import run_ranks
from sample_workers import samples_on_ranks
from traced_models import Looped, looped_batch, mse

ADVICE = "pass every rank the same sample (its sizes decide the trace)"


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """One spawn for every case here."""
    found: list[dict[str, Any]] = run_ranks(samples_on_ranks, 2, timeout=240.0)
    return found


def _named(message: str, first: str, second: str) -> None:
    assert "the ranks were given different samples to trace" in message, message
    assert f"rank 0 {first}" in message and f"rank 1 {second}" in message, message
    assert message.endswith(ADVICE), message


def test_other_rows_name_both_samples_on_every_rank(two_ranks: list[dict[str, Any]]) -> None:
    for found in two_ranks:
        _named(found["rows"], "{'x': Tensor(4, 8):float64, 'weight': Tensor(4,):float64}",
               "{'x': Tensor(6, 8):float64, 'weight': Tensor(6,):float64}")


def test_another_key_names_both_samples_on_every_rank(two_ranks: list[dict[str, Any]]) -> None:
    for found in two_ranks:
        _named(found["key"], "{'x': Tensor(4, 8):float64, 'weight': Tensor(4,):float64}",
               "{'x': Tensor(4, 8):float64, 'scale': Tensor(4,):float64}")


def test_another_dtype_names_both_samples(two_ranks: list[dict[str, Any]]) -> None:
    for found in two_ranks:
        _named(found["dtype"], "{'x': Tensor(4, 8):float64, 'weight': Tensor(4,):float64}",
               "{'x': Tensor(4, 8):float64, 'weight': Tensor(4,):float32}")


def test_the_same_sample_still_steps_exactly(two_ranks: list[dict[str, Any]]) -> None:
    batch, target = looped_batch(rows=4)
    plain = copy.deepcopy(Looped())
    expected = mse(plain(**batch), target).item()  # the mean over two equal micro-batches
    losses = [found["same"] for found in two_ranks]
    assert losses[-1] == pytest.approx(expected, abs=1e-10)


def test_an_nn_sequential_needs_no_sample_beyond_rank_0(two_ranks: list[dict[str, Any]]) -> None:
    assert [found["sequential"] for found in two_ranks] == ["ok", "ok"]
