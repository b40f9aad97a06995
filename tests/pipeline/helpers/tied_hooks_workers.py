"""Models and rank functions for tests/pipeline/compute/test_tied_hooks.py (importable by name)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

WIDTH, WORDS, ROWS, MICROBATCHES = 6, 11, 8, 4


def tied(layers: int = 4) -> nn.Sequential:
    """An embedding, ``layers - 2`` Linear+Tanh pairs' worth of body, and a head tied to it."""
    torch.manual_seed(0)
    embedding, head = nn.Embedding(WORDS, WIDTH), nn.Linear(WIDTH, WORDS, bias=False)
    head.weight = embedding.weight
    body = [nn.Linear(WIDTH, WIDTH) if i % 2 == 0 else nn.Tanh() for i in range(layers - 2)]
    return nn.Sequential(embedding, *body, head).double()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randint(0, WORDS, (ROWS,), generator=generator),
            torch.randint(0, WORDS, (ROWS,), generator=generator))


def record(parameter: nn.Parameter, forget: bool = False) -> list[torch.Tensor]:
    """Each ``.grad`` a post-accumulate hook of ``parameter`` sees; ``forget``: the hook
    then drops it (``.grad = None``), as an optimizer stepping in backward does."""
    seen: list[torch.Tensor] = []

    def hook(p: torch.Tensor) -> None:
        assert p.grad is not None
        seen.append(p.grad.detach().clone())
        if forget:
            p.grad = None

    parameter.register_post_accumulate_grad_hook(hook)
    return seen


def plain(model: nn.Sequential, forget: bool = False
          ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The plain model, one backward per micro-batch (losses weighted by their share): what
    the tied weight's hook saw, and its gradient after."""
    reference = copy.deepcopy(model)
    seen = record(reference[0].weight, forget)
    x, y = batch()
    for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
        (nn.functional.cross_entropy(reference(xs), ys) * len(xs) / len(x)).backward()
    return seen, reference[0].weight.grad


def difference(found: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """The worst difference between two lists of gradients; inf if their lengths differ."""
    if len(found) != len(expected):
        return float("inf")
    return max((float((a - b).abs().max()) for a, b in zip(found, expected)), default=0.0)


def hooks_across_ranks(rank: int, world: int) -> tuple[str, bool]:
    """A tied weight on both ranks with a hook: the step's error, and whether every local
    gradient is still None after it."""
    from pipeline import Pipe

    torch.set_num_threads(1)
    model = tied()
    pipe = Pipe(model, MICROBATCHES, schedule="1f1b", loss_fn=nn.CrossEntropyLoss(),
                balance=[2, 2], group=dist.group.WORLD)
    local = [p for p in pipe.model.parameters() if not p.is_meta]
    record(local[0] if rank == 0 else pipe.model[3].weight)
    x, y = batch()
    try:
        pipe.step(x if rank == 0 else None, y if rank == 1 else None)
        said = "returned"
    except ValueError as error:
        said = str(error)
    untouched = all(p.grad is None for p in local)
    pipe.close()
    return said, untouched


def hooks_on_one_rank(rank: int, world: int) -> tuple[float, float]:
    """ZB-V on 2 ranks puts the embedding (chunk 0) and the head (chunk 3) on rank 0: the
    hook's values and the final gradient against the plain model's (rank 1: zeros)."""
    from pipeline import Pipe

    torch.set_num_threads(1)
    model = tied(8)
    expected, expected_grad = plain(model)
    pipe = Pipe(model, MICROBATCHES, schedule="zb-v", loss_fn=nn.CrossEntropyLoss(),
                balance=[2, 2, 2, 2], group=dist.group.WORLD, checkpoint="never")
    seen = record(pipe.model[0].weight) if rank == 0 else []
    x, y = batch()
    pipe.step(x if rank == 0 else None, y if rank == 0 else None)
    pipe.close()
    if rank != 0:
        return 0.0, 0.0
    grad: Any = pipe.model[0].weight.grad
    return difference(seen, expected), float((grad - expected_grad).abs().max())
