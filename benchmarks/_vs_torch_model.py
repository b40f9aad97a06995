"""bench_vs_torch's model and batch: the balanced MLP that it and bench_schedules_measured time.

``use_model`` switches the width and batch for ``bench_vs_torch --model``; read WIDTH and
BATCH through the module (``_vs_torch_model.WIDTH``), not by importing the names, to see
the switch.
"""

from __future__ import annotations

from typing import Any

WIDTH, BLOCKS, BATCH = 512, 8, 384  # ~100 ms for a whole-batch step on one thread
MODELS = {"mlp": (1024, 256), "tiny": (16, 64)}  # --model: (width, batch), BLOCKS layers each
STAGES = 2


def use_model(name: str) -> None:
    """Switch the module's model and batch (in this process: each rank calls it too)."""
    global WIDTH, BATCH
    WIDTH, BATCH = MODELS[name]


def make_model(seed: int = 0) -> Any:
    """The balanced MLP: BLOCKS x (Linear, ReLU), flat, so a uniform cut is balanced."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def make_batch(seed: int = 1) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, WIDTH, generator=generator),
            torch.randn(BATCH, WIDTH, generator=generator))
