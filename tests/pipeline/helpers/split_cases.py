"""The layers that broke the per-layer split backward, as models, and their sweep on a runtime.

Each case is a float64 model, a batch, a loss and a cut that puts the layer in
question inside a chunk (and, for repeated outputs, across a stage boundary too).
``sweep`` runs every case under the split schedules (and 1F1B as a control),
every checkpoint mode and both split paths (the graph split; Linear layers that
defer their own weight gradients, every one of them, with the graph split for the
rest), and returns per combination the largest gradient difference against the
unpipelined model (the loss's own parameters included), how often each held
parameter's post-accumulate hook fired, and how many layers the split switched.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import zoo
from zoo_workers import CHUNKS, MODES, Runtime

SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zb", "zb-v", "v-half", "v-min", "dualpipe-v")
PATHS = ("graph", "layers")  # Pipe(split_backward=...): the graph split, Linear layers deferring
WIDTH, ROWS = 8, 12
Row = dict[str, Any]


class Repeat(nn.Module):
    """Returns one tensor twice: ``(h, h)``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.linear(x)
        return h, h


class Derived(Repeat):
    """Returns a tensor and one derived from it: ``(h, h.mean(1))``."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        h = self.linear(x)
        return h, h.mean(1, keepdim=True)


class Join(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.tanh(pair[0]) * 2 + pair[1] * pair[0]


class Block(nn.Module):
    """A residual LayerNorm + MLP block (the unit ALBERT shares)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TemperatureLoss(nn.Module):
    """A CLIP-style loss: cross-entropy of logits scaled by a learned temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(0.5, dtype=torch.float64))

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits * self.log_scale.exp(), target)


class Reentrant(nn.Module):
    """A block under ``checkpoint(use_reentrant=True)``: its backward runs the engine again,
    and refuses an engine call that names inputs (as I's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=True)


class HookedOutputs(nn.Module):
    """Tensor hooks where the split captures a layer's output gradient, registered anew each
    forward: a Linear's output x3, a clamp on ``h @ w``, ``-2x`` and a counting one on ``h * g``.
    ``calls`` counts each hook's calls."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / 3)
        self.gain = nn.Parameter(torch.randn(WIDTH))
        self.calls = [0, 0, 0, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._hooked(self.linear(x), 0, lambda grad: grad * 3)
        h = self._hooked(torch.tanh(h) @ self.weight, 1, lambda grad: grad.clamp(-0.005, 0.005))
        h = self._hooked(torch.tanh(h) * self.gain, 2, lambda grad: -2 * grad)
        return self._hooked(h, 3, lambda grad: None)

    def _hooked(self, h: torch.Tensor, index: int,
                hook: Callable[[torch.Tensor], torch.Tensor | None]) -> torch.Tensor:
        if h.requires_grad:  # not under torch.no_grad()
            h.register_hook(_counted(self.calls, index, hook))
        return h


class TiedEmbedding(nn.Module):
    """A soft embedding that reads a head's weight (the tie of a language model's head)."""

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.weight = head.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        classes = self.weight.shape[0]
        return h + torch.softmax(h[:, :classes], -1) @ self.weight


class Twice(nn.Module):
    """One Linear called twice in a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.tanh(self.linear(x)))


class SelfAttention(nn.Module):
    """Each row as two tokens through ``nn.MultiheadAttention`` (which calls linear on its own
    weights, not through Linear modules), with a residual; rows stay independent."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(WIDTH // 2, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.view(x.shape[0], 2, WIDTH // 2)
        return x + self.attention(tokens, tokens, tokens, need_weights=False)[0].reshape(x.shape)


class Convolution(nn.Module):
    """Each row as two channels of four positions through a Conv1d (reflect-padded) and back."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 2, 3, padding=1, padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(x.view(x.shape[0], 2, WIDTH // 2))).reshape(x.shape)


class Norms(nn.Module):
    """A LayerNorm and a GroupNorm (``hook_norms`` hooks their parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_norm, self.group_norm = nn.LayerNorm(WIDTH), nn.GroupNorm(2, WIDTH)
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.calls = [0, 0, 0, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.group_norm(torch.tanh(self.layer_norm(x))))


def hook_norms(model: nn.Module) -> None:
    """Tensor hooks on every ``Norms``' parameters: scaling, masking, a clamp, logging only.

    Each is linear in the gradient or leaves it, so that one call per micro-batch sums to
    the plain model's one call on the batch.
    """
    for module in model.modules():
        if not isinstance(module, Norms):
            continue
        hooks: list[Callable[[torch.Tensor], torch.Tensor | None]] = [
            lambda grad: grad * 3, lambda grad: grad * (torch.arange(WIDTH) % 2),
            lambda grad: -0.5 * grad, lambda grad: None]
        parameters = [module.layer_norm.weight, module.layer_norm.bias,
                      module.group_norm.weight, module.group_norm.bias]
        for index, (parameter, hook) in enumerate(zip(parameters, hooks)):
            parameter.register_hook(_counted(module.calls, index, hook))


def _counted(calls: list[int], index: int,
             hook: Callable[[torch.Tensor], torch.Tensor | None]) -> Callable[[torch.Tensor], torch.Tensor | None]:
    def counted(grad: torch.Tensor) -> torch.Tensor | None:
        calls[index] += 1
        return hook(grad)

    return counted


def hook_calls(model: nn.Module) -> list[int]:
    """How often each tensor hook of the held ``HookedOutputs`` and ``Norms`` ran."""
    return [count for module in model.modules() if isinstance(module, (HookedOutputs, Norms))
            and not any(p.is_meta for p in module.parameters()) for count in module.calls]


def _around(layer: Callable[[], nn.Module],
            between: Callable[[], nn.Module] = nn.Tanh) -> Callable[[], nn.Sequential]:
    """A factory of Linear, ``layer``, ``between``, Linear, ``layer``, head: the layer under
    test in both halves of the cut."""
    return lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), layer(), between(),
                                 nn.Linear(WIDTH, WIDTH), layer(), nn.Linear(WIDTH, 3))


def _repeat_model(kind: type[Repeat]) -> nn.Sequential:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), kind(), Join(), nn.Linear(WIDTH, WIDTH),
                         kind(), Join(), nn.Linear(WIDTH, 3))


def _tied_model() -> nn.Sequential:
    first, second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
    second.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), second, nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, 3))


def _shared_block_model() -> nn.Sequential:
    block = Block()
    return nn.Sequential(block, block, block, nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, 3))


def _tied_head_model() -> nn.Sequential:
    head = nn.Linear(WIDTH, 3)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         TiedEmbedding(head), nn.Linear(WIDTH, WIDTH), head)



def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 3))


@dataclass(frozen=True)
class Case:
    """A model, its loss, and its cut for one and for two chunks per stage."""

    build: Callable[[], nn.Sequential]
    loss: Callable[[], nn.Module]
    balance: tuple[int, ...]
    balance_v: tuple[int, ...]
    hooks: Callable[[nn.Module], None] | None = None  # registers parameter hooks on a copy


CASES = {
    "repeated outputs": Case(lambda: _repeat_model(Repeat), nn.CrossEntropyLoss, (2, 5), (2, 2, 2, 1)),
    "derived outputs": Case(lambda: _repeat_model(Derived), nn.CrossEntropyLoss, (2, 5), (2, 2, 2, 1)),
    "weight tied in a chunk": Case(_tied_model, nn.CrossEntropyLoss, (3, 3), (3, 1, 1, 1)),
    "one block at three positions": Case(_shared_block_model, nn.CrossEntropyLoss, (3, 3), (3, 1, 1, 1)),
    "loss with a parameter": Case(_mlp, TemperatureLoss, (3, 3), (3, 1, 1, 1)),
    "reentrant checkpoint": Case(_around(Reentrant, Reentrant), nn.CrossEntropyLoss, (3, 3),
                                 (2, 2, 1, 1)),
    "hooked outputs": Case(_around(HookedOutputs), nn.CrossEntropyLoss, (3, 3), (2, 1, 2, 1)),
    "tied head in a chunk": Case(_tied_head_model, nn.CrossEntropyLoss, (4, 3), (2, 1, 1, 3)),
    "a Linear called twice": Case(_around(Twice), nn.CrossEntropyLoss, (3, 3), (2, 1, 2, 1)),
    "self-attention": Case(_around(SelfAttention), nn.CrossEntropyLoss, (3, 3), (2, 1, 2, 1)),
    "convolutions": Case(_around(Convolution, Convolution), nn.CrossEntropyLoss, (3, 3),
                         (2, 1, 2, 1)),
    "hooked norm parameters": Case(_around(Norms), nn.CrossEntropyLoss, (3, 3), (2, 1, 2, 1),
                                   hooks=hook_norms),
}


def _model(case: Case) -> nn.Sequential:
    torch.manual_seed(0)
    return case.build().double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (ROWS,), generator=generator))


def _loss_error(trained: nn.Module, expected: nn.Module) -> float:
    worst = 0.0
    for mine, theirs in zip(trained.parameters(), expected.parameters()):
        if mine.is_meta:
            continue
        worst = max(worst, float("inf") if mine.grad is None else zoo.difference(mine.grad, theirs.grad))
    return worst


def _hooked(model: nn.Module) -> dict[str, list[int]]:
    fired: dict[str, list[int]] = {}
    for key, parameter in zoo.per_layer_parameters(model).items():
        if parameter.is_meta or id(parameter) in {id(p) for p in fired.values()}:
            continue
        counter = fired.setdefault(key, [0])
        parameter.register_post_accumulate_grad_hook(lambda _, counter=counter: counter.__setitem__(0, counter[0] + 1))
    return fired


@dataclass(frozen=True)
class Reference:
    """A case's model before any step, its batch, and the plain model's step on it: the same
    for every schedule, mode and path of the case, so a sweep computes it once per case."""

    model: nn.Sequential  # never run: each step trains a deep copy
    x: torch.Tensor
    y: torch.Tensor
    plain: nn.Module  # the model after one plain step (its tensor hooks counted)
    loss: nn.Module  # the plain step's loss, with its parameters' gradients
    expected: dict[str, torch.Tensor]  # the plain model's gradients, by layer

    @classmethod
    def of(cls, name: str) -> Reference:
        case = CASES[name]
        model, (x, y) = _model(case), _batch()
        plain, loss = copy.deepcopy(model), case.loss()
        if case.hooks is not None:
            case.hooks(plain)  # a deep copy leaves tensor hooks behind
        loss(plain(x), y).backward()
        return cls(model, x, y, plain, loss, zoo.per_layer_grads(plain))


def run_case(runtime: Runtime, name: str, schedule: str, mode: str, path: str = "graph",
             reference: Reference | None = None) -> Row:
    """One step of one case: gradient errors against the plain model, and hook counts.

    ``reference``: the case's ``Reference``, if already computed (else it is, here)."""
    from schedules import get_schedule

    case = CASES[name]
    reference = Reference.of(name) if reference is None else reference
    x, y = reference.x, reference.y
    trained, loss_fn = copy.deepcopy(reference.model), copy.deepcopy(reference.loss)
    loss_fn.zero_grad(set_to_none=True)
    per_stage = get_schedule(schedule, 2, CHUNKS).chunks // 2
    balance = list(case.balance if per_stage == 1 else case.balance_v)
    pipe = runtime.pipe(trained, schedule, mode, loss_fn, balance=balance, split_backward=path)
    if case.hooks is not None:
        case.hooks(trained)
    fired = _hooked(trained)
    pipe.step(x, y)
    grad_error, compared = zoo.grad_errors(trained, reference.expected)
    holds_loss = not runtime.distributed or pipe.schedule.placement[-1] == _rank()
    return {
        "grad_error": grad_error, "compared": compared,
        "loss_grad_error": _loss_error(loss_fn, reference.loss) if holds_loss else 0.0,
        "hooks": sorted({count[0] for count in fired.values()}),
        "tensor_hooks": sorted(set(hook_calls(trained))),
        "reference_tensor_hooks": sorted(set(hook_calls(reference.plain))),
        "switched": sum("forward" in module.__dict__ for module in trained.modules()),
    }


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


# On 2 ranks the sweep is the suite's longest test (576 Pipes, 90-230 s on 2 cores): there
# it runs a schedule of each family, 1F1B the control, and recomputation on and off; one
# process runs everything.
RANK_SCHEDULES = ("1f1b", "zb-h1", "zb-v", "dualpipe-v")
RANK_MODES = ("always", "never")


def sweep(distributed: bool) -> list[Row]:
    """Every case x split schedule x checkpoint mode x split path (on ranks: the schedules
    and modes above); a failure is a row, never an abort."""
    runtime = Runtime(distributed)
    rows = []
    for name in CASES:
        try:
            reference: Reference | None = Reference.of(name)
        except Exception:  # noqa: BLE001 - then each row of the case raises it as its error
            reference = None
        for schedule in RANK_SCHEDULES if distributed else SCHEDULES:
            for mode in RANK_MODES if distributed else MODES:
                for path in PATHS:
                    row: Row = {"case": name, "schedule": schedule, "mode": mode, "path": path,
                                "error": None}
                    try:
                        row.update(run_case(runtime, name, schedule, mode, path, reference))
                    except Exception as error:  # noqa: BLE001 - reported per combination
                        row["error"] = zoo.failure_text(error)
                    rows.append(row)
    return rows


def on_rank(rank: int, world: int) -> list[Row]:
    """The entry point of each spawned gloo rank."""
    torch.set_num_threads(1)
    return sweep(distributed=True)
