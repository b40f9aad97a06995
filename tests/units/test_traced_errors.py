"""What cannot be traced or run as traced is refused with an error that says what to do,
never run down a branch frozen for another input."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipeline import Pipe, StageError
from traced_models import Block, Looped, loss_options, looped_batch, mse
from units import TraceError


class ValueBranch(Block):
    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if h.sum() > 0:  # a branch on a tensor's value: a graph cannot follow it
            return h * 2
        return h


class HookingBlock(Block):
    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        out = super().forward(h, scale)
        out.register_hook(lambda grad: grad * 3)  # lost in a graph: refused
        return out


class SizeBranch(Block):
    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if h.shape[0] > 3:  # a branch on a size: export guards it
            return h * 2
        return h - 1


class Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).double()

    def forward(self, x: torch.Tensor, double: bool = False) -> torch.Tensor:
        x = self.blocks(x)
        return x * 2 if double else x


def _looped_with(block: type[Block]) -> Looped:
    model = Looped()
    model.blocks = nn.ModuleList(block(8) for _ in range(4)).double()
    return model


def _pipe(model: nn.Module, sample, **extra) -> Pipe:
    return Pipe(model, chunks=2, sample=sample, devices=["cpu", "cpu"], loss_fn=mse, **extra)


def test_a_model_that_is_not_sequential_needs_a_sample() -> None:
    with pytest.raises(ValueError, match="needs sample=.* to cut a Looped"):
        Pipe(Looped(), chunks=2, devices=["cpu", "cpu"], loss_fn=mse)


def test_not_a_module_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="needs an nn.Module.*got function"):
        Pipe(lambda x: x, chunks=2, devices=["cpu", "cpu"], loss_fn=mse)


def test_units_for_a_sequential_is_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="an nn.Sequential's layers are its units"):
        Pipe(model, chunks=2, devices=["cpu", "cpu"], loss_fn=mse, units=["0"])


def test_units_naming_no_module_that_runs_lists_names_that_do() -> None:
    batch, _ = looped_batch()
    with pytest.raises(TraceError, match=r"no operation .* runs in \['blocks.9'\].*'stem'"):
        _pipe(Looped(), batch, units=["blocks.1", "blocks.9"])


def test_units_out_of_order_are_refused() -> None:
    batch, _ = looped_batch()
    with pytest.raises(TraceError, match="in the order the forward runs them"):
        _pipe(Looped(), batch, units=["blocks.2", "blocks.1"])


def test_units_given_cut_there_and_stay_exact() -> None:
    model = Looped()
    batch, target = looped_batch()
    plain_loss = mse(model(**batch), target)
    plain_loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with _pipe(model, batch, units=["blocks.1", "blocks.3"]) as pipe:
        assert [u.name for u in pipe.units] == ["(prologue)", "blocks.1", "blocks.3"]
        loss = pipe.step(batch, target)
    assert abs(loss.item() - plain_loss.item()) < 1e-12
    for name, p in model.named_parameters():
        assert (p.grad - expected[name]).abs().max().item() < 1e-12, name


@pytest.mark.parametrize(("block", "message"), [
    (ValueBranch, r"cannot trace Looped in 'blocks.0': its Python control flow depends on "
                  r"tensor values"),
    (HookingBlock, r"registers a tensor hook at .*test_traced_errors.py:\d+ "
                   r"\(out.register_hook"),
])
def test_a_forward_a_graph_cannot_hold_is_refused_saying_where(block: type[Block],
                                                                message: str) -> None:
    """A branch on a tensor's value (naming the module) or a tensor hook (naming the line)."""
    batch, _ = looped_batch()
    with pytest.raises(TraceError, match=message):
        _pipe(_looped_with(block), batch)


def test_a_branch_on_a_size_never_runs_for_another_size() -> None:
    """A micro-batch that breaks a guard gets a trace of its own, which takes the branch the
    plain model takes on it; a size the new trace cannot run either is refused."""
    batch, target = looped_batch(rows=8)
    model = _looped_with(SizeBranch)
    plain = copy.deepcopy(model)
    with _pipe(model, batch) as pipe:  # micro-batches of 4 rows: > 3
        pipe.step(batch, target)
        small, _ = looped_batch(rows=4)  # micro-batches of 2 rows: traced again
        halves = [{key: value[rows] for key, value in small.items()}
                  for rows in (slice(0, 2), slice(2, 4))]
        with torch.no_grad():
            expected = torch.cat([plain(**half) for half in halves])
            assert (pipe(small) - expected).abs().max().item() < 1e-12
            assert (pipe(batch) - plain(**batch)).abs().max().item() < 1e-12  # the first trace
        assert [len(variants) for variants in pipe.model[0]._variants.values()] == [2, 1]


def test_a_batch_with_other_keys_is_refused() -> None:
    batch, target = looped_batch()
    with _pipe(Looped(), batch) as pipe:
        with pytest.raises(ValueError, match=r"traced with the batch \{'x': .*'weight'.*got "
                                             r"\{'x'"):
            pipe.step({"x": batch["x"]}, target)
        swapped = {"weight": batch["weight"], "x": batch["x"]}  # key order does not matter
        pipe.step(swapped, target)


def test_a_non_tensor_argument_is_frozen_and_checked() -> None:
    x = torch.randn(4, 4, dtype=torch.float64)
    with _pipe(Flagged(), {"x": x, "double": True}) as pipe:
        output = pipe({"x": x, "double": True})
        assert torch.allclose(output, pipe.source_model(x, double=True))
        with pytest.raises(ValueError, match="non-tensor argument value True .* got False"):
            pipe({"x": x, "double": False})


class NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(6, 6), nn.BatchNorm1d(6)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.linear(h)))


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(4, 6), nn.Linear(6, 2)
        self.blocks = nn.ModuleList(NormBlock() for _ in range(3))
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


@pytest.mark.parametrize("mode", ["never", "always", "except_last"])
def test_batch_norm_in_a_traced_model_counts_each_micro_batch_once(mode: str) -> None:
    """As the plain model run micro-batch by micro-batch: statistics and gradients."""
    import copy

    torch.manual_seed(0)
    model = Normed()
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    with _pipe(model, x, checkpoint=mode) as pipe:
        pipe.step(x, y)
    for part, target in zip(x.chunk(2), y.chunk(2)):
        (mse(plain(part), target) / 2).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert (p.grad - q.grad).abs().max().item() < 1e-12, name
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_deferred_batch_norm_is_refused_for_a_traced_model() -> None:
    x = torch.randn(8, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"deferred_batch_norm=True .* a traced model does not "
                                         r"call \(3 BatchNorm layers, e.g. 'blocks.0.norm'\)"):
        _pipe(Normed(), x, deferred_batch_norm=True)


def test_a_module_backward_hook_is_refused() -> None:
    model = Looped()
    model.blocks[1].mix.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    batch, _ = looped_batch()
    with pytest.raises(TraceError, match=r"module backward hooks on \['blocks.1.mix'\]"):
        _pipe(model, batch)


def test_forward_hooks_are_traced_exactly_and_a_later_one_is_refused() -> None:
    import copy

    batch, target = looped_batch()
    plain_without = Looped()
    with _pipe(copy.deepcopy(plain_without), batch) as pipe:  # traced first, without hooks
        pipe.step(batch, target)
    model = Looped()
    model.blocks[0].mix.register_forward_hook(lambda module, args, output: output * 0.5)
    model.blocks[2].register_forward_pre_hook(lambda module, args: (args[0] * 2, args[1]))
    plain = copy.deepcopy(model)
    mse(plain(**batch), target).backward()
    with _pipe(model, batch) as pipe:  # the same make with hooks: traced anew, not reused
        pipe.step(batch, target)
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert (p.grad - q.grad).abs().max().item() < 1e-12, name
        model.head.register_forward_hook(lambda module, args, output: output + 1)
        with pytest.raises(ValueError, match=r"head.s hooks changed \(_forward_hooks\)"):
            pipe.step(batch, target)


def test_a_model_on_the_meta_device_is_refused() -> None:
    with torch.device("meta"):
        model = Looped()
    batch, _ = looped_batch()
    with pytest.raises(TraceError, match=r"must be real: \d+ are on the meta device .*'stem"):
        _pipe(model, batch)


def test_a_none_argument_is_a_constant_of_the_graph() -> None:
    from traced_models import llama, tokens

    batch, target = tokens()
    without_mask = dict(batch, attention_mask=None)
    with Pipe(llama(layers=2), chunks=2, sample=without_mask, devices=["cpu", "cpu"],
              **loss_options("llama")) as pipe:
        pipe.step(without_mask, target)
        with pytest.raises(ValueError, match=r"non-tensor argument value None .* got "
                                             r"Tensor\(4, 12\):int64"):
            pipe.step(batch, target)
