"""A Pipe changes nothing outside itself that it does not undo: after ``close()`` the user's
layers carry no forward of the Pipe's (a split backward switches them on while it runs)."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

from pipeline import Pipe, SummedLoss


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


def _attributes(model: nn.Module) -> dict[str, set[str]]:
    return {name: set(vars(module)) for name, module in model.named_modules()}


def _zb_cases() -> list[tuple[str, str]]:
    return [("sequential", "zb-h1"), ("sequential", "zb-v"), ("llama", "zb-h1"),
            ("llama", "zb-v")]


@pytest.mark.parametrize(("kind", "schedule"), _zb_cases())
def test_after_close_no_module_has_an_attribute_it_did_not_have(kind: str,
                                                                 schedule: str) -> None:
    if kind == "llama":
        from tests.units.traced_models import llama, lm_loss, token_count, tokens

        model, (x, y) = llama(layers=4), tokens()
        options = {"sample": x, "loss_fn": SummedLoss(lm_loss, token_count)}
    else:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4))).double()
        x, y = torch.randn(8, 64, dtype=torch.float64), torch.randn(8, 64, dtype=torch.float64)
        options = {"loss_fn": nn.MSELoss(), "balance": [1, 1, 1, 1] if schedule == "zb-v"
                   else [2, 2]}
    before = _attributes(model)
    plain = copy.deepcopy(model)
    with Pipe(model, chunks=4, devices=["cpu", "cpu"], schedule=schedule,
              split_backward="layers", **options) as pipe:
        pipe.step(x, y)
        assert _instance_forwards(model)  # deferring layers are switched on while it runs
    assert _attributes(model) == before
    assert _instance_forwards(model) == []
    with torch.no_grad():
        mine = model(**x) if isinstance(x, dict) else model(x)
        theirs = plain(**x) if isinstance(x, dict) else plain(x)
    mine = mine.logits if kind == "llama" else mine
    theirs = theirs.logits if kind == "llama" else theirs
    assert torch.equal(mine, theirs)
