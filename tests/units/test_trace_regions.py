"""What export makes of a forward as people write it: grad-mode and autocast regions (export's
own subgraphs, kept in the units' programs), every config's key/value cache off for the trace,
flags passed through ``**kwargs``, and a trace error naming the module whose code branches."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipeline import Pipe
from traced_models import Block, Looped, looped_batch, mse
from units import TraceError

TOLERANCE = 1e-10


class GradRegions(Block):
    """A block computing part of itself under ``torch.no_grad()``, and within that a part
    under ``torch.enable_grad()`` again."""

    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            gate = torch.sigmoid(self.gate(h))  # no gradient reaches the gate
            with torch.enable_grad():
                mixed = self.mix(self.norm(h))  # gradients again
        return h + mixed * gate * scale


class Centred(Looped):
    """Grad-mode regions in every block and one in the model's own loop, after block 1."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(GradRegions(8) for _ in range(4)).double()

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        skip = h
        scale = torch.sigmoid(weight).unsqueeze(-1)
        for index, block in enumerate(self.blocks):
            h = block(h, scale)
            if index == 1:
                with torch.no_grad():
                    centre = h.mean(-1, keepdim=True)
                h = h - centre
        return self.head(torch.cat([h, skip], dim=-1))


class Autocast(Block):
    """A block whose mixing runs in bfloat16 under ``torch.autocast``."""

    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = self.mix(h)
        return h + mixed.double() * torch.sigmoid(self.gate(self.norm(h))) * scale


def _autocast_model() -> Looped:
    model = Looped()
    model.blocks = nn.ModuleList(Autocast(8) for _ in range(4)).double()
    return model


def _plain(model: nn.Module, batch: dict[str, Any], target: torch.Tensor
           ) -> tuple[float, dict[str, torch.Tensor | None]]:
    """The plain model's loss and gradients (None where none reaches) on the whole batch."""
    model = copy.deepcopy(model)
    loss = mse(model(**batch), target)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def _piped(model: nn.Module, batch: dict[str, Any], target: torch.Tensor, **options: Any
           ) -> tuple[float, dict[str, torch.Tensor | None]]:
    options = {"chunks": 2, "schedule": "1f1b", **options}
    with Pipe(model, sample=batch, devices=["cpu", "cpu"], loss_fn=mse, **options) as pipe:
        loss = pipe.step(batch, target)
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def _assert_close(got: tuple[float, dict[str, Any]], expected: tuple[float, dict[str, Any]],
                  tolerance: float) -> None:
    assert abs(got[0] - expected[0]) < tolerance
    assert set(got[1]) == set(expected[1])
    for name, grad in got[1].items():
        if expected[1][name] is None:
            assert grad is None, f"{name} has a gradient the plain model does not give it"
            continue
        assert grad is not None, name
        assert (grad - expected[1][name]).abs().max().item() < tolerance, name


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_grad_mode_regions_are_exact(schedule: str, checkpoint: str) -> None:
    model = Centred()
    batch, target = looped_batch()
    expected = _plain(model, batch, target)
    assert expected[1]["blocks.0.gate.weight"] is None  # the no_grad region holds
    assert expected[1]["blocks.0.mix.weight"] is not None  # the enable_grad one too
    _assert_close(_piped(model, batch, target, schedule=schedule, checkpoint=checkpoint),
                  expected, TOLERANCE)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_grad_mode_regions_in_units_given_are_exact(schedule: str) -> None:
    """Units begin at blocks 1 and 3: the model's own region (after block 1) is in the middle
    unit's program, and every program holds a block's regions."""
    model = Centred()
    batch, target = looped_batch()
    expected = _plain(model, batch, target)
    units = ["blocks.1", "blocks.3"] if schedule == "1f1b" else [
        "blocks.1", "blocks.2", "blocks.3"]
    _assert_close(_piped(model, batch, target, schedule=schedule, units=units),
                  expected, TOLERANCE)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_autocast_regions_run_as_in_the_plain_model(schedule: str) -> None:
    """The loss is the plain model's to float64 rounding (each row's bfloat16 products are
    the same in a micro-batch), and further from the model without autocast; gradients
    within a quarter of bfloat16's epsilon (2**-8), as a weight's gradient is summed per
    micro-batch (here they agree to 1e-15)."""
    model = _autocast_model()
    batch, target = looped_batch()
    loss, grads = _plain(model, batch, target)
    without = copy.deepcopy(model)
    for block in without.blocks:
        block.__class__ = Block  # the same weights, no autocast
    in_float64 = mse(without(**batch), target).item()
    got_loss, got_grads = _piped(model, batch, target, schedule=schedule)
    assert abs(got_loss - loss) < 1e-12 < abs(in_float64 - loss)  # autocast ran
    for name, grad in got_grads.items():
        expected = grads[name]
        assert grad is not None and expected is not None, name
        assert (grad - expected).abs().max().item() <= 1e-3 * expected.abs().max().item(), name


@pytest.mark.parametrize("make", [Centred, _autocast_model])
def test_regions_run_in_the_evaluation_forward(make: Any) -> None:
    """The evaluation program keeps its regions too: ``pipe(x)`` after ``model.eval()``
    returns the plain model's output."""
    model = make()
    batch, _ = looped_batch()
    with Pipe(model, chunks=2, sample=batch, devices=["cpu", "cpu"], loss_fn=mse) as pipe:
        model.eval()
        with torch.no_grad():
            output = pipe(batch)
            expected = model(**batch)
    assert (output - expected).abs().max().item() < 1e-12


def _t5() -> nn.Module:
    """A tiny T5ForConditionalGeneration with its default config (``use_cache=True``, which
    its decoder holds in a config of its own)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1,
                      num_decoder_layers=2, num_heads=2, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5ForConditionalGeneration(config).double()


def _seq2seq_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), labels.flatten())


def test_t5_with_its_default_config_is_exact() -> None:
    model = _t5()
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    assert len(configs) > 1 and all(c.use_cache for c in configs.values()
                                    if c.is_decoder or c is model.config)
    generator = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(2, 32, (4, 7), generator=generator),
             "decoder_input_ids": torch.randint(2, 32, (4, 5), generator=generator)}
    labels = torch.randint(2, 32, (4, 5), generator=generator)
    plain = copy.deepcopy(model)
    expected = _seq2seq_loss(plain(**batch), labels)
    expected.backward()
    with Pipe(model, chunks=2, sample=batch, devices=["cpu", "cpu"],
              loss_fn=_seq2seq_loss) as pipe:
        loss = pipe.step(batch, labels)
    assert abs(loss.item() - expected.item()) < TOLERANCE
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad is not None and q.grad is not None, name
        assert (p.grad - q.grad).abs().max().item() < TOLERANCE, name
    assert [c.use_cache for c in configs.values()] == [
        c.use_cache for c in {id(m.config): m.config for m in plain.modules()
                              if hasattr(m, "config")}.values()]  # restored


def test_every_config_is_restored_after_the_trace_even_on_error() -> None:
    from transformers import LlamaConfig, T5Config

    from units.trace import _no_cache

    root, inner = nn.Module(), nn.Module()
    root.inner = inner
    root.config = T5Config()
    root.config.text_config = LlamaConfig()  # a nested config
    inner.config = T5Config(is_decoder=True)
    configs = [root.config, root.config.text_config, inner.config]
    with pytest.raises(RuntimeError, match="inside"):
        with _no_cache(root):
            assert [c.use_cache for c in configs] == [False, False, False]
            raise RuntimeError("inside")
    assert [c.use_cache for c in configs] == [True, True, True]


class RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Routed(nn.Module):
    """A mixture of experts as people write it: each expert runs on the rows routed to it,
    skipped when there are none (a branch on a tensor's value)."""

    def __init__(self, width: int, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        chosen = self.router(h).topk(2, dim=-1).indices
        out = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            rows = (chosen == index).any(-1).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            out = out.index_add(0, rows, expert(h[rows]))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.self_attn = nn.Linear(width, width)
        self.post_attention_layernorm = RMSNorm(width)
        self.mlp = Routed(width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(h)
        return h + self.mlp(self.post_attention_layernorm(h))


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(DecoderLayer(8) for _ in range(2))
        self.double()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(h)
        return h


def test_a_trace_error_names_the_module_whose_code_branches() -> None:
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(TraceError, match=r"in 'layers\.0\.mlp':.*tensor values") as error:
        Pipe(MoE(), chunks=2, sample=x, devices=["cpu", "cpu"], loss_fn=mse)
    assert "post_attention_layernorm" not in str(error.value)


class Keywords(nn.Module):
    """A forward that takes its options through ``**kwargs``, as Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        x = self.blocks(x)
        if kwargs.get("double"):
            x = x * 2
        return x * kwargs["scale"] if "scale" in kwargs else x


@pytest.mark.parametrize("with_tensor", [False, True])
def test_flags_passed_through_kwargs_are_exact(with_tensor: bool) -> None:
    model = Keywords()
    generator = torch.Generator().manual_seed(1)
    batch: dict[str, Any] = {"x": torch.randn(4, 4, generator=generator, dtype=torch.float64),
                             "double": True}
    if with_tensor:  # a tensor through **kwargs too, split into micro-batches
        batch["scale"] = torch.rand(4, 1, generator=generator, dtype=torch.float64)
    target = torch.randn(4, 4, generator=generator, dtype=torch.float64)
    expected = _plain(model, batch, target)
    _assert_close(_piped(model, batch, target, units=["blocks.0", "blocks.2"]), expected,
                  TOLERANCE)
    assert model.forward.__func__ is Keywords.forward  # the trace left the model as it was
