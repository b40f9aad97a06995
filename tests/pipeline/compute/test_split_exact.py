"""The split backward is exact on the layers that broke it, in one process and on 2 gloo ranks.

Per case (``split_cases``): outputs that repeat, ``(h, h)``, or derive from one
another, ``(h, h.mean(1))``; a weight tied between two layers of one chunk; one
block instance at three positions (ALBERT-style); a loss with a learnable
temperature; a reentrant checkpoint; tensor hooks on layer outputs where the
split captures their gradient and on norm parameters; a head whose weight a soft
embedding in the same chunk reads; a Linear called twice; ``nn.MultiheadAttention``, whose
projections are functional linear calls on its own weights; reflect-padded convolutions. Every split schedule
(1F1B as the control), every checkpoint mode and both split paths (the graph
split, and Linear layers deferring their own weight gradients with the graph split
for the rest): each held gradient, the loss's parameter included, equals the unpipelined
model's to 1e-10, and every parameter's post-accumulate hook fires once per
micro-batch, as it does in a plain backward per micro-batch; so does each
tensor hook.
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
            where = f"rank {rank} {row['schedule']} checkpoint={row['mode']} {row['path']}"
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
@pytest.mark.parametrize("case", ["loss with a parameter", "hooked norm parameters",
                                  "weight tied in a chunk", "tied head in a chunk",
                                  "a Linear called twice", "self-attention", "convolutions"])
def test_post_accumulate_hooks_fire_once_per_microbatch(runtime: str, case: str) -> None:
    def once_each(row: dict[str, Any]) -> str | None:
        return None if row["hooks"] == [CHUNKS] else f"hooks fired {row['hooks']} times"

    assert _problems(runtime, case, once_each) == []


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("case", ["hooked outputs", "hooked norm parameters"])
def test_tensor_hooks_run_once_per_microbatch(runtime: str, case: str) -> None:
    """Where the split captures a gradient (a layer's output, a norm's parameter), each tensor
    hook runs once per micro-batch, as in a plain backward per micro-batch (a norm parameter's
    ran twice, and its gradient was 9x for a 3x hook)."""
    def once_each(row: dict[str, Any]) -> str | None:
        if row["reference_tensor_hooks"] != [1]:
            return f"the plain model's hooks ran {row['reference_tensor_hooks']} times"
        return None if row["tensor_hooks"] == [CHUNKS] else f"tensor hooks ran {row['tensor_hooks']} times"

    assert _problems(runtime, case, once_each) == []


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_layers_path_switches_linear_layers_under_split_schedules(runtime: str) -> None:
    """Else the layers rows would be graph rows again: every held chunk of a split schedule
    switches its Linear layers at its first I; the graph path and 1F1B never do."""
    def switched(row: dict[str, Any]) -> str | None:
        wanted = row["path"] == "layers" and row["schedule"] != "1f1b"
        return None if (row["switched"] > 0) == wanted else f"{row['switched']} layers switched"

    assert [problem for case in split_cases.CASES
            for problem in _problems(runtime, case, switched)] == []


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v", "dualpipe-v"])
def test_compiled_blocks_stay_exact_under_split_schedules(schedule: str) -> None:
    """torch.compile'd blocks (one autograd.Function each, donating buffers) in one process."""
    import torch
    from torch import nn

    from pipeline import Pipe

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), split_cases.Block(), split_cases.Block(),
                              nn.Linear(8, 3)).double()
        model[1] = torch.compile(model[1], backend="aot_eager")
        model[2] = torch.compile(model[2], backend="aot_eager")
        return model

    x = torch.randn(12, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (12,))
    reference = build()
    nn.functional.cross_entropy(reference(x), y).backward()
    model = build()
    balance = [2, 2] if schedule == "zb-h1" else [1, 1, 1, 1]
    pipe = Pipe(model, 4, balance=balance, devices=["cpu", "cpu"], schedule=schedule,
                loss_fn=nn.CrossEntropyLoss(), checkpoint="except_last")
    pipe.step(x, y)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=TOLERANCE, rtol=0)
