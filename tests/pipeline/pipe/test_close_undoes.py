"""A Pipe changes nothing outside itself that it does not undo: after ``close()`` the user's
layers carry no forward of the Pipe's (a split backward switches them on while it runs)."""

from __future__ import annotations

import copy
import types

import torch
from torch import nn

from pipeline import Pipe


def _instance_forwards(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if "forward" in vars(module)]


def test_closing_takes_the_switched_forwards_off_and_keeps_the_users_own() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4))).double()
    own = types.MethodType(lambda self, x: 2 * nn.Linear.forward(self, x), model[3])
    model[3].forward = own  # the user's own instance forward: it runs, and it stays
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    nn.MSELoss()(plain(x), y).backward()
    with Pipe(model, chunks=4, balance=[2, 2], devices=["cpu", "cpu"], schedule="zb-h1",
              loss_fn=nn.MSELoss()) as pipe:
        pipe.step(x, y)
        assert _instance_forwards(model) == ["0", "1", "2", "3"]  # switched while it runs
    assert _instance_forwards(model) == ["3"] and model[3].forward is own
    for p, q in zip(model.parameters(), plain.parameters()):
        assert (p.grad - q.grad).abs().max().item() < 1e-12


class Looped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def test_closing_a_traced_pipe_leaves_its_linears_as_they_were() -> None:
    model = Looped()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    with Pipe(model, chunks=2, sample=x, devices=["cpu", "cpu"], schedule="zb-v",
              loss_fn=nn.functional.mse_loss) as pipe:
        pipe.step(x, y)
        assert _instance_forwards(model)  # its Linear modules are switched too
        pipe.step(x, y)  # and a step after the first still passes the model's check
    assert _instance_forwards(model) == []
