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
from split_backward.switched_layers import switched

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
    return sum(switched(module) for module in model.modules())


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
@pytest.mark.parametrize("mode", ["never", "always"])
def test_bf16_autocast_equals_the_plain_model_under_autocast(schedule: str, path: str,
                                                             mode: str) -> None:
    """Deferred products multiply what autocast's would (the bf16 casts of input and output
    gradient): bit for bit the plain model's under autocast, as the unsplit 1F1B is, the
    recomputation in I included. A W multiplying the float32 input instead differs by bf16
    rounding (~1e-3)."""
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    reference, model = _wide(), _wide()
    _reference(reference, x, y, lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    pipe = _pipe(model, schedule, path, checkpoint=mode)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe.step(x, y)
    assert (_switched(model) > 0) == (path != "graph" and schedule != "1f1b")
    pipe.close()
    assert _switched(model) == 0  # closing takes them off
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


class Block(nn.Module):
    """A residual LayerNorm + MLP block; ``policy``: its MLP under selective checkpointing."""

    def __init__(self, width: int = 8, policy: Callable[..., CheckpointPolicy] | None = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.policy = policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.policy is None or not torch.is_grad_enabled():
            return x + self.mlp(h)
        context = functools.partial(create_selective_checkpoint_contexts, self.policy)
        return x + checkpoint(self.mlp, h, use_reentrant=False, context_fn=context)


def _save_products(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the matrix products' outputs, recompute the rest (GELU, views)."""
    products = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if op in products else CheckpointPolicy.PREFER_RECOMPUTE


def _float64_step(build: Callable[[], nn.Sequential], schedule: str, path: str,
                  balance: list[int] | None = None, **options: Any) -> tuple[set[str], float]:
    """One step of a float64 model on a Pipe: the names of the layers switched while it was
    open, and the worst gradient difference from the plain model micro-batch by
    micro-batch."""
    torch.manual_seed(1)
    x, y = torch.randn(12, 8, dtype=torch.float64), torch.randint(0, 3, (12,))
    reference, model = build(), build()
    _reference(reference, x, y, loss_fn=nn.functional.cross_entropy)
    pipe = Pipe(model, CHUNKS, balance=balance or _balance(schedule), devices=["cpu", "cpu"],
                schedule=schedule, split_backward=path, loss_fn=nn.CrossEntropyLoss(), **options)
    pipe.step(x, y)
    switched_while_open = {name for name, module in model.named_modules() if switched(module)}
    pipe.close()
    assert _switched(model) == 0  # closing takes them off
    worst = max(float((p.grad - q.grad).abs().max())
                for p, q in zip(model.parameters(), reference.parameters()))
    return switched_while_open, worst


@pytest.mark.parametrize("schedule, path", [("zb-h1", "layers"), ("zb-v", "layers")])
def test_compiled_blocks_under_the_layers_path(schedule: str, path: str) -> None:
    """A compiled block is one autograd.Function whose backward computes its input and weight
    gradients together: it runs whole in I (its Linear layers stay unswitched), the
    layers around it defer."""
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), Block(), Block(), nn.Linear(8, 8), Block(),
                              nn.Linear(8, 3)).double()
        for index in (1, 2, 4):
            model[index] = torch.compile(model[index], backend="aot_eager")
        return model

    balance = [3, 3] if schedule == "zb-h1" else [2, 1, 2, 1]
    names, worst = _float64_step(build, schedule, path, balance, checkpoint="except_last")
    assert worst < 1e-10
    assert {"0", "5"} <= names and not any(name.split(".")[0] == "1" for name in names)


@pytest.mark.parametrize("schedule, path", [("zb-h1", "layers"), ("zb-v", "layers"),
                                            ("zb-h1", "auto"), ("zb-v", "graph")])
@pytest.mark.parametrize("mode", ["never", "always"])
def test_selective_activation_checkpointing_inside_a_block(schedule: str, path: str,
                                                           mode: str) -> None:
    """The recomputation runs inside I with the layers switched as in the forward: the
    deferred products' saved outputs come from SAC's cache, the rest recomputed."""
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), Block(policy=_save_products), nn.Tanh(),
                             Block(policy=_save_products), Block(policy=_save_products),
                             nn.Linear(8, 3)).double()

    balance = [3, 3] if schedule == "zb-h1" else [2, 1, 2, 1]
    switched_while_open, worst = _float64_step(build, schedule, path, balance, checkpoint=mode)
    assert worst < 1e-10
    assert bool(switched_while_open) == (path == "layers" or path == "auto")


def test_post_accumulate_hooks_see_each_microbatchs_gradient_once() -> None:
    """A head tied to a soft embedding in its chunk and a Linear used twice, the Linear
    layers deferring: each parameter's post-accumulate hook fires once per micro-batch and
    sees what the plain model's sees after that micro-batch."""
    class Tied(nn.Module):
        def __init__(self, head: nn.Linear) -> None:
            super().__init__()
            self.weight = head.weight

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + torch.softmax(h[:, :3], -1) @ self.weight

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(torch.tanh(self.linear(x)))

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        head = nn.Linear(8, 3)
        return nn.Sequential(nn.Linear(8, 8), Twice(), nn.Tanh(), Tied(head), Twice(), head).double()

    seen: dict[int, dict[str, list[torch.Tensor]]] = {}

    def hooked(model: nn.Module) -> nn.Module:
        record = seen.setdefault(len(seen), {})
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda p, calls=record.setdefault(name, []): calls.append(p.grad.clone()))
        return model

    torch.manual_seed(1)
    x, y = torch.randn(12, 8, dtype=torch.float64), torch.randint(0, 3, (12,))
    reference, model = hooked(build()), hooked(build())
    _reference(reference, x, y, loss_fn=nn.functional.cross_entropy)
    pipe = Pipe(model, CHUNKS, balance=[3, 3], devices=["cpu", "cpu"], schedule="zb-h1",
                split_backward="layers", loss_fn=nn.CrossEntropyLoss())
    pipe.step(x, y)
    assert _switched(model) == 4
    pipe.close()
    expected, found = seen[0], seen[1]
    assert list(found) == list(expected) and len(found) == 8  # the tied weight once
    for name in expected:
        assert len(found[name]) == len(expected[name]) == CHUNKS, name
        for mine, theirs in zip(found[name], expected[name]):
            assert float((mine - theirs).abs().max()) < 1e-10, name
