"""Randomness, private generators and in-place input writes that show only after
micro-batch 0 (issue 31, rows 4-6): every checkpoint mode matches the plain model in
float64 and the modes agree with one seed, in one process and on two gloo ranks."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from detection_cases import MODELS, TOLERANCE, run_case
from dist_harness import run_ranks
from dist_workers import detection_rows

MODES = ("never", "always", "except_last")
CASES = tuple(MODELS)
RANK_SCHEDULES = ("1f1b", "zb-h1")


def _check(result: dict[str, Any], label: Any) -> None:
    assert result["compared"] > 0, label
    assert result["error"] < TOLERANCE, f"{label}: {result['error']:.3g} off the plain model"
    assert result["x_kept"], f"{label}: the caller's x was modified"


def _check_modes_agree(results: dict[str, dict[str, Any]], label: Any) -> None:
    never = results["never"]
    for mode in ("always", "except_last"):
        assert abs(results[mode]["loss"] - never["loss"]) < TOLERANCE, (label, mode)
        assert results[mode]["grads"].keys() == never["grads"].keys(), (label, mode)
        worst = max((torch.as_tensor(results[mode]["grads"][name]) - torch.as_tensor(grad))
                    .abs().max().item() for name, grad in never["grads"].items())
        assert worst < TOLERANCE, f"{label}: {mode} is {worst:.3g} off never, one seed"


@pytest.mark.parametrize(("case", "schedule"),
                         list(itertools.product(CASES, ("gpipe", "1f1b", "zb-h1"))))
def test_every_mode_matches_the_plain_model_and_the_modes_agree(case: str, schedule: str) -> None:
    results = {mode: run_case(case, schedule, mode, devices=["cpu", "cpu"]) for mode in MODES}
    for mode, result in results.items():
        _check(result, (case, schedule, mode))
    _check_modes_agree(results, (case, schedule))


def test_the_drawing_layers_draw_nothing_in_microbatch_zero() -> None:
    """The case is what it claims: both NoisyRows draw for some rows, none of micro-batch 0."""
    for layer in run_case("draws", "1f1b", "never", devices=["cpu", "cpu"])["rows_drawn"]:
        assert layer[0] == 0 and sum(layer) > 0, layer


def test_a_generator_hidden_in_a_closure_is_the_documented_limit() -> None:
    """A generator the layers' attributes do not show cannot be put back for a
    recomputation: the recomputed numbers differ (torch.utils.checkpoint's too). Without
    recomputation the step is exact."""
    from pipeline import Pipe  # noqa: F401  (the limit is the Pipe's, documented there)
    import detection_cases

    original = detection_cases.MODELS["generator"]
    detection_cases.MODELS["generator"] = lambda: detection_cases.generator_model(closure=True)
    try:
        never = run_case("generator", "1f1b", "never", devices=["cpu", "cpu"])
        always = run_case("generator", "1f1b", "always", devices=["cpu", "cpu"])
    finally:
        detection_cases.MODELS["generator"] = original
    assert never["error"] < TOLERANCE
    assert always["error"] > 1e-3, "a closure's generator was handled: update the docs"


@pytest.fixture(scope="module")
def on_two_ranks() -> list[list[Any]]:
    runs = tuple(itertools.product(CASES, RANK_SCHEDULES, MODES))
    per_rank = run_ranks(detection_rows, 2, runs, timeout=600)
    return [dict(zip(runs, results)) for results in per_rank]


@pytest.mark.parametrize(("case", "schedule"), list(itertools.product(CASES, RANK_SCHEDULES)))
def test_on_two_ranks(on_two_ranks: list[dict[Any, Any]], case: str, schedule: str) -> None:
    for rank, results in enumerate(on_two_ranks):
        by_mode = {mode: results[(case, schedule, mode)] for mode in MODES}
        for mode, result in by_mode.items():
            _check(result, (rank, case, schedule, mode))
        _check_modes_agree(by_mode, (rank, case, schedule))
