"""Where the split backward meets the rest, in one process: autocast, GradScaler, compiled blocks,
selective activation checkpointing, hooks on a tied head and a Linear used twice.

Each case trains one step of a Pipe under a split schedule (ZB-H1, ZB-V) with
layers that defer their own weight gradients (``split_backward="layers"``, and
``"auto"``), and compares every gradient with the unpipelined model run micro-batch
by micro-batch in the same context (autocast, a scaled loss), which is what the
split must reproduce; the graph split and 1F1B (no split) run as controls.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from pipeline import Pipe

CHUNKS = 4
RUNS = (("zb-h1", "layers"), ("zb-h1", "auto"), ("zb-v", "layers"), ("zb-v", "auto"),
        ("zb-h1", "graph"), ("1f1b", "auto"))


def _wide(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """Products of 8 x 256 x 256 multiply-adds: ``"auto"`` defers them too."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.LayerNorm(256),
                         nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8)).to(dtype)


def _balance(schedule: str) -> list[int]:
    return [2, 2, 2, 1] if schedule == "zb-v" else [4, 3]


def _float_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), target)


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
               context: Callable[[], AbstractContextManager[Any]] = nullcontext,
               scale: float = 1.0, loss_fn: Callable[..., torch.Tensor] = _float_loss) -> None:
    """The plain model's backward per micro-batch, as a Pipe splits and weights the batch."""
    for x_part, y_part in zip(x.chunk(CHUNKS), y.chunk(CHUNKS)):
        with context():
            loss = loss_fn(model(x_part), y_part) / CHUNKS * scale
        loss.backward()


def _switched(model: nn.Module) -> int:
    return sum("forward" in module.__dict__ for module in model.modules())


def _pipe(model: nn.Module, schedule: str, path: str, **options: Any) -> Pipe:
    options.setdefault("loss_fn", _float_loss)
    options.setdefault("checkpoint", "never")
    return Pipe(model, CHUNKS, balance=_balance(schedule), devices=["cpu", "cpu"],
                schedule=schedule, split_backward=path, **options)


def _worst(model: nn.Module, reference: nn.Module) -> float:
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        worst = max(worst, float(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30))))
    return worst


@pytest.mark.parametrize("schedule, path", RUNS)
def test_bf16_autocast_equals_the_plain_model_under_autocast(schedule: str, path: str) -> None:
    """Deferred products multiply what autocast's would (the bf16 casts of input and output
    gradient): bit for bit the plain model's under autocast, as the unsplit 1F1B is. A W
    multiplying the float32 input instead differs by bf16 rounding (~1e-3)."""
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    reference, model = _wide(), _wide()
    _reference(reference, x, y, lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    pipe = _pipe(model, schedule, path)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe.step(x, y)
    pipe.close()
    assert (_switched(model) > 0) == (path != "graph" and schedule != "1f1b")
    # The layers path's first micro-batches run before its layers are switched on (the
    # graph split): their norm gradients accumulate in W, the others in I, in another
    # order than the plain model's (float32 rounding, not bf16's).
    assert _worst(model, reference) < 1e-6


@pytest.mark.parametrize("schedule, path", RUNS)
def test_fp16_autocast_with_a_grad_scaler(schedule: str, path: str) -> None:
    """The scaled loss reaches W's products: unscaled gradients equal the plain model's under
    fp16 autocast with the same scale (a W that missed the scale would be 4096x off)."""
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    reference, model = _wide(), _wide()
    _reference(reference, x, y, lambda: torch.autocast("cpu", dtype=torch.float16), scale=2.0**12)
    for p in reference.parameters():
        p.grad /= 2.0**12
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    pipe = _pipe(model, schedule, path)
    with torch.autocast("cpu", dtype=torch.float16):
        pipe.step(x, y, scaler=scaler)
    pipe.close()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.unscale_(optimizer)
    assert _worst(model, reference) < 1e-6
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
