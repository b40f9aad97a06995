"""A Pipe runs one call at a time: a forward from a second thread during a step waits for
it (both exact), and a call from inside a running one is refused at once."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from torch import nn

from pipeline import Pipe, StageError


class Slow(nn.Module):
    """A layer that sleeps in its forward, so that a step is still running when asked."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return x * 1.0


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Slow(), nn.Tanh(), nn.Linear(4, 2)).double()


def test_a_forward_from_another_thread_waits_for_the_step() -> None:
    model = _model()
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    nn.functional.mse_loss(plain(x), y).backward()
    with Pipe(model, chunks=4, devices=["cpu", "cpu"], loss_fn=nn.MSELoss()) as pipe:
        results: dict[str, object] = {}
        stepping = threading.Thread(target=lambda: results.update(loss=pipe.step(x, y)))
        stepping.start()
        time.sleep(0.1)  # the step is sleeping in its first micro-batches
        with torch.no_grad():
            output = pipe(x)
        stepping.join(timeout=30)
        assert not stepping.is_alive()
    assert torch.allclose(output, plain(x), atol=1e-12)
    assert abs(results["loss"].item() - nn.functional.mse_loss(plain(x), y).item()) < 1e-12
    for p, q in zip(model.parameters(), plain.parameters()):
        assert (p.grad - q.grad).abs().max().item() < 1e-12


def test_a_call_from_inside_a_running_one_is_refused_at_once() -> None:
    model = _model()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    holder: dict[str, Pipe] = {}

    def loss_calling_the_pipe(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        holder["pipe"](x)
        return nn.functional.mse_loss(output, target)

    with Pipe(model, chunks=2, devices=["cpu", "cpu"], loss_fn=loss_calling_the_pipe,
              timeout=20) as pipe:
        holder["pipe"] = pipe
        began = time.monotonic()
        with pytest.raises(StageError, match=r"pipe\(x\) was called from inside pipe.step\(\)"):
            pipe.step(x, y)
        assert time.monotonic() - began < 10  # at once, not after a wait for itself
