"""Models and rank functions for tests/pipeline/runtime/test_step_state.py (by name)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from models import tied_head

WIDTH, ROWS, CHUNKS = 6, 16, 8


class Faulty(nn.Module):
    """Raises on the ``fail_at``-th call while armed (a bad micro-batch, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.armed, self.fail_at, self.calls = False, 3, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.calls += 1
            if self.calls == self.fail_at:
                raise RuntimeError("a bad micro-batch")
        return self.linear(x)


def faulty_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, WIDTH), Faulty(), nn.Tanh(), nn.Linear(WIDTH, 3)).double()


def tied_model() -> nn.Sequential:
    torch.manual_seed(0)
    return tied_head(WIDTH)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (ROWS,), generator=generator))


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return (torch.randint(0, 11, (ROWS, 5), generator=generator),
            torch.randint(0, 11, (ROWS, 5), generator=generator))


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def per_layer(model: nn.Sequential) -> dict[str, nn.Parameter]:
    """``"{layer}.{name}"`` -> parameter, a tied one under every layer that holds it."""
    return {f"{index}.{name}": p for index, layer in enumerate(model)
            for name, p in layer.named_parameters()}


def reference_two_steps(model: nn.Sequential, x: Any, y: Any, loss_fn: Any) -> dict[str, torch.Tensor]:
    """Gradients after two plain backward passes without zero_grad."""
    model = copy.deepcopy(model)
    for _ in range(2):
        loss_fn(model(x), y).backward()
    return {key: p.grad.clone() for key, p in per_layer(model).items()}


def worst(model: nn.Sequential, expected: dict[str, torch.Tensor]) -> float:
    """The largest gradient difference over the parameters this process holds."""
    differences = [float((p.grad - expected[key]).abs().max())
                   for key, p in per_layer(model).items() if not p.is_meta]
    return max(differences)


def tied_accumulation(rank: int, world: int, schedule: str) -> float:
    """Two steps without zero_grad on ranks: the worst difference from the plain model's."""
    import torch.distributed as dist

    from pipeline import Pipe

    torch.set_num_threads(1)
    model = tied_model()
    x, y = tokens()
    expected = reference_two_steps(model, x, y, lm_loss)
    pipe = Pipe(model, CHUNKS, schedule=schedule, loss_fn=lm_loss, group=dist.group.WORLD,
                checkpoint="never", timeout=20)
    for _ in range(2):
        pipe.step(x, y)
    result = worst(model, expected)
    pipe.close()
    return result


def failed_step(rank: int, world: int, schedule: str) -> tuple[bool, bool, str, float]:
    """A step that raises on rank 1 at micro-batch 3: is every rank's state as before it, does
    the error say so, and is the next step (accumulating) exact?"""
    import torch.distributed as dist

    from pipeline import Pipe

    torch.set_num_threads(1)
    model = faulty_model()
    x, y = batch()
    loss_fn = nn.CrossEntropyLoss()
    untroubled = copy.deepcopy(model)  # BatchNorm: the reference is the pipeline, unfailed
    reference = Pipe(untroubled, CHUNKS, schedule=schedule, loss_fn=loss_fn,
                     group=dist.new_group(list(range(world))), balance=[3, 4],
                     checkpoint="never", timeout=20)
    for _ in range(2):
        reference.step(x, y)
    expected = {key: p.grad for key, p in per_layer(untroubled).items() if not p.is_meta}
    # On a fresh group: the failed step leaves messages in flight on it, the world group
    # as it was for the calls that follow in the same spawn.
    pipe = Pipe(model, CHUNKS, schedule=schedule, loss_fn=loss_fn,
                group=dist.new_group(list(range(world))), balance=[3, 4], checkpoint="never",
                timeout=20)
    pipe.step(x, y)
    grads = {key: p.grad for key, p in per_layer(model).items() if not p.is_meta}
    values = {key: g.clone() for key, g in grads.items()}
    statistics = [b.clone() for b in model.buffers() if not b.is_meta]
    model[4].armed = True
    message = ""
    try:
        pipe.step(x, y)
    except Exception as error:  # noqa: BLE001 - what the test inspects
        message = f"{error} {' '.join(getattr(error, '__notes__', []))}"
    model[4].armed = False
    same_grads = all(p.grad is grads[key] and torch.equal(p.grad, values[key])
                     for key, p in per_layer(model).items() if not p.is_meta)
    same_statistics = all(torch.equal(a, b) for a, b in
                          zip((b for b in model.buffers() if not b.is_meta), statistics))
    # The failed step left messages in flight: a new Pipe on a fresh group takes the next step.
    group = dist.new_group(list(range(world)))
    pipe = Pipe(model, CHUNKS, schedule=schedule, loss_fn=loss_fn, group=group, balance=[3, 4],
                checkpoint="never", timeout=20)
    pipe.step(x, y)
    return same_grads, same_statistics, message, worst(model, expected)
