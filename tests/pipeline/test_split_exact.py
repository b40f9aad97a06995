"""The split backward is exact on the layers that broke it, in one process and on 2 gloo ranks.

Per case (``split_cases``): outputs that repeat, ``(h, h)``, or derive from one
another, ``(h, h.mean(1))``; a weight tied between two layers of one chunk; one
block instance at three positions (ALBERT-style); a loss with a learnable
temperature. Every split schedule (1F1B as the control) and every checkpoint
mode: each held gradient, the loss's parameter included, equals the unpipelined
model's to 1e-10, and every parameter's post-accumulate hook fires once per
micro-batch, as it does in a plain backward per micro-batch.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

import split_cases
from dist_harness import run_ranks
from zoo_workers import CHUNKS

TOLERANCE = 1e-10
RUNTIMES = ("one process", "two ranks")


@cache
def results(runtime: str) -> list[list[dict[str, Any]]]:
    if runtime == "one process":
        return [split_cases.sweep(distributed=False)]
    return run_ranks(split_cases.on_rank, 2, timeout=600.0)


def _problems(runtime: str, case: str, check: Any) -> list[str]:
    problems = []
    for rank, rows in enumerate(results(runtime)):
        for row in rows:
            if row["case"] != case:
                continue
            where = f"rank {rank} {row['schedule']} checkpoint={row['mode']}"
            if row["error"] is not None:
                problems.append(f"{where}: {row['error']}")
            elif (trouble := check(row)) is not None:
                problems.append(f"{where}: {trouble}")
    return problems


def _exact(row: dict[str, Any]) -> str | None:
    if not row["compared"]:
        return "no parameter compared"
    if not row["grad_error"] < TOLERANCE or not row["loss_grad_error"] < TOLERANCE:
        return f"gradient error {row['grad_error']:.3g}, loss parameter {row['loss_grad_error']:.3g}"
    return None


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("case", list(split_cases.CASES))
def test_gradients_equal_the_plain_models(runtime: str, case: str) -> None:
    assert _problems(runtime, case, _exact) == []


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_post_accumulate_hooks_fire_once_per_microbatch(runtime: str) -> None:
    def once_each(row: dict[str, Any]) -> str | None:
        return None if row["hooks"] == [CHUNKS] else f"hooks fired {row['hooks']} times"

    assert _problems(runtime, "loss with a parameter", once_each) == []
