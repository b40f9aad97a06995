"""Rank functions for tests/pipeline/runtime/test_inference.py (importable by name)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn


def small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(),
                         nn.Linear(6, 3)).double()


def inference_then_training(pipe: object, model: nn.Sequential, plain: nn.Sequential
                            ) -> list[tuple[str, float]]:
    """``pipe(x)`` under ``torch.inference_mode()``, then a training step, then ``pipe`` of
    an inference tensor outside it, then under it again: per call, the largest difference
    from the plain model (output; loss and gradients for the step), ``plain`` being a copy
    of ``model`` made before the Pipe was built. A rank without the output reports 0 for
    it; any error propagates."""
    from pipeline import Pipe

    assert isinstance(pipe, Pipe)
    x = torch.randn(9, 6, dtype=torch.float64)
    y = torch.randn(9, 3, dtype=torch.float64)
    with torch.no_grad():
        expected = plain(x)
    loss = nn.MSELoss()(plain(x), y)
    loss.backward()
    with torch.inference_mode():
        inference_x = x.clone()

    def output_difference(out: torch.Tensor | None) -> float:
        return 0.0 if out is None else float((out - expected).abs().max())

    rows = []
    with torch.inference_mode():
        rows.append(("inference_mode", output_difference(pipe(x))))
    found = pipe.step(x, y)
    grads = [float((p.grad - q.grad).abs().max()) for p, q in
             zip(model.parameters(), plain.parameters()) if not p.is_meta]
    rows.append(("step after it", max(abs(float(found) - loss.item()), *grads)))
    rows.append(("an inference tensor", output_difference(pipe(inference_x))))
    with torch.inference_mode():
        rows.append(("inference_mode again", output_difference(pipe(x))))
    return rows


def under_inference_mode(rank: int, world: int, schedules: tuple[tuple[str, str], ...]
                         ) -> list[tuple[str, str, float]]:
    """``inference_then_training`` on 2 ranks per (schedule, transport): rows of
    (schedule and transport, call, difference)."""
    from pipeline import Distributed, Pipe

    torch.set_num_threads(1)
    rows = []
    for schedule, transport in schedules:
        model = small_model()
        plain = copy.deepcopy(model)
        pipe = Pipe(model, 3, schedule=schedule, timeout=30.0, loss_fn=nn.MSELoss(),
                    distributed=Distributed(dist.group.WORLD, transport=transport))
        rows += [(f"{schedule} {transport}", call, difference)
                 for call, difference in inference_then_training(pipe, model, plain)]
        pipe.close()
    return rows
