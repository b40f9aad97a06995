"""A trace never runs for a model it does not describe, and runs each submodule in its own mode.

A second model of the same make that differs in anything its forward reads gets a trace of
its own (exact); the same model changed after ``Pipe()`` is refused before any gradient
changes, the change named; a frozen BatchNorm in a training model stays frozen.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pipeline import Pipe
from traced_models import mse


class TunableBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.drop = nn.Dropout(0.0)
        self.act: Callable[[torch.Tensor], torch.Tensor] = torch.tanh
        self.gains = [1.0]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.gains[0] * self.act(self.drop(self.mix(self.norm(h))))


class Tunable(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(TunableBlock(8) for _ in range(3))
        self.head = nn.Linear(8, 3)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return (torch.randn(6, 8, generator=generator, dtype=torch.float64),
            torch.randn(6, 3, generator=generator, dtype=torch.float64))


def _pipe(model: nn.Module, x: Any) -> Pipe:
    return Pipe(model, chunks=2, sample=x, devices=["cpu", "cpu"], loss_fn=mse)


def _assert_exact(model: nn.Module) -> None:
    """A Pipe's step on ``model`` leaves the plain model's gradients (float64, 1e-10)."""
    x, y = _batch()
    plain = copy.deepcopy(model)
    mse(plain(x), y).backward()
    with _pipe(model, x) as pipe:
        pipe.step(x, y)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert (p.grad - q.grad).abs().max().item() < 1e-10, name


def _sin(model: Tunable) -> None:
    model.blocks[1].act = torch.sin


def _gains(model: Tunable) -> None:
    model.blocks[0].gains = [0.5]


def _gains_in_place(model: Tunable) -> None:
    model.blocks[2].gains[0] = 3.5


def _instance_forward(model: Tunable) -> None:
    def doubled(self: TunableBlock, h: torch.Tensor) -> torch.Tensor:
        return 2 * h + self.mix(h)

    model.blocks[1].forward = types.MethodType(doubled, model.blocks[1])  # type: ignore[method-assign]


@pytest.mark.parametrize("change", [_sin, _gains, _gains_in_place, _instance_forward])
def test_a_model_of_the_same_make_that_differs_gets_its_own_trace(
        change: Callable[[Tunable], None]) -> None:
    _assert_exact(Tunable())  # traced (or reused) as made
    model = Tunable(seed=1)
    change(model)
    _assert_exact(model)


def _dropout_off(model: Tunable) -> str:
    model.blocks[0].drop.p = 0.5
    return ""


def _replace_activation(model: Tunable) -> str:
    model.blocks[1].act = torch.sin
    return r"blocks.1.act is <torch.sin> \(traced: <torch.tanh>\)"


def _epsilon(model: Tunable) -> str:
    model.blocks[2].norm.eps = 0.5
    return r"blocks.2.norm.eps is 0.5 \(traced: 1e-05\)"


def _module_replaced(model: Tunable) -> str:
    model.blocks[0].norm = nn.LayerNorm(8).double()
    return r"blocks.0.norm was replaced by another LayerNorm"


def _adapter(model: Tunable) -> str:
    model.blocks[1].mix.lora = nn.Linear(8, 8, bias=False).double()
    return r"a module was added at blocks.1.mix.lora \(Linear\)"


def _monkeypatched(model: Tunable) -> str:
    _instance_forward(model)
    return r"blocks.1.forward was replaced"


def _list_in_place(model: Tunable) -> str:
    model.blocks[0].gains[0] = 0.25
    return r"blocks.0.gains is \[0.25\] \(traced: \[1.0\]\)"


def _new_parameter(model: Tunable) -> str:
    model.blocks[0].register_parameter("scale", nn.Parameter(torch.ones(8, dtype=torch.float64)))
    return r"blocks.0's parameters and buffers are now \['scale:float64'\]"


def _half(model: Tunable) -> str:
    model.blocks[2].mix.float()
    return (r"blocks.2.mix's parameters and buffers are now \['weight:float32', "
            r"'bias:float32'\] \(traced: \['weight:float64', 'bias:float64'\]\)")


@pytest.mark.parametrize("change", [_dropout_off, _replace_activation, _epsilon,
                                    _module_replaced, _adapter, _monkeypatched,
                                    _list_in_place, _new_parameter, _half])
def test_a_change_after_pipe_is_refused_before_any_gradient(change: Callable[[Tunable], str]
                                                            ) -> None:
    model = Tunable()
    x, y = _batch()
    with _pipe(model, x) as pipe:
        pipe.step(x, y)  # as traced: runs
        parameters = list(model.parameters())
        grads = [p.grad.clone() for p in parameters]
        expected = change(model) or r"blocks.0.drop.p is 0.5 \(traced: 0.0\)"
        with pytest.raises(ValueError, match=r"the model changed since the Pipe traced it \(.*"
                                             + expected):
            pipe.step(x, y)
        with pytest.raises(ValueError, match="the model changed since the Pipe traced it"):
            pipe(x)
        # (.float() converts the gradients too: compared in their dtype now)
        assert all(torch.equal(p.grad, g.to(p.grad.dtype)) for p, g in zip(parameters, grads))


def test_a_hook_removed_and_another_added_is_seen_by_reference() -> None:
    model = Tunable()
    x, y = _batch()
    handle = model.blocks[0].register_forward_hook(lambda module, args, output: output * 0.5)
    with _pipe(model, x) as pipe:
        pipe.step(x, y)
        handle.remove()
        model.blocks[0].register_forward_hook(lambda module, args, output: output * 0.25)
        with pytest.raises(ValueError, match=r"blocks.0's hooks changed \(_forward_hooks\)"):
            pipe.step(x, y)


def test_the_config_is_seen() -> None:
    from traced_models import llama, tokens

    model = llama()
    batch, labels = tokens()
    with Pipe(model, chunks=2, sample=batch, devices=["cpu", "cpu"],
              loss_fn=lambda out, y: out.logits.sum()) as pipe:
        model.config.output_hidden_states = True
        with pytest.raises(ValueError, match=r"the model changed since the Pipe traced it \("
                                             r"the model.config is a LlamaConfig with other"):
            pipe.step(batch, labels)


class Normed(Tunable):
    """Blocks with BatchNorm, as fine-tuning freezes them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()) for _ in range(3))
        for block in self.blocks:  # running statistics of a pretrained model
            block[1].running_mean.uniform_(-1, 1)
            block[1].running_var.uniform_(0.5, 2)
        self.double()


def _frozen_norms(model: nn.Module) -> list[nn.Module]:
    model.train()
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    for norm in norms:
        norm.eval()
    return norms


def test_a_frozen_batchnorm_in_a_training_model_stays_frozen() -> None:
    model = Normed()
    norms = _frozen_norms(model)
    statistics = [(n.running_mean.clone(), n.running_var.clone()) for n in norms]
    _assert_exact(model)
    for norm, (mean, var) in zip(norms, statistics):
        assert torch.equal(norm.running_mean, mean) and torch.equal(norm.running_var, var)


def test_evaluation_and_a_mode_changed_since_the_trace() -> None:
    model = Normed()
    norms = _frozen_norms(model)
    x, y = _batch()
    with _pipe(model, x) as pipe:
        model.eval()  # every module in evaluation mode: the evaluation graph
        with torch.no_grad():
            assert (pipe(x) - model(x)).abs().max().item() < 1e-12
        model.train()  # the norms train now, as they were not traced
        with pytest.raises(ValueError, match=r"blocks.0.1 is in training mode, traced in "
                                             r"evaluation mode"):
            pipe.step(x, y)
        for norm in norms:
            norm.eval()
        pipe.step(x, y)  # as traced again


def test_private_bookkeeping_added_since_is_not_a_change() -> None:
    model = Tunable()
    x, y = _batch()
    with _pipe(model, x) as pipe:
        model.blocks[0].mix._is_fsdp_managed_module = True  # as fully_shard marks modules
        pipe.step(x, y)
        model.blocks[0].mix.public_flag = True
        with pytest.raises(ValueError, match=r"blocks.0.mix.public_flag is True \(traced: unset\)"):
            pipe.step(x, y)
