"""Cut the model into its chunks: consecutive slices of layers, each moved to its stage's device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn

from schedules import Schedule

from pipeline.compute.chunk import ChunkSpec

Chunk = TypeVar("Chunk")


def slices(model: nn.Sequential, balance: Sequence[int]) -> list[tuple[int, nn.Sequential]]:
    """Cut ``model`` into consecutive slices: (first layer index, layers sharing the modules)."""
    found = []
    first = 0
    for count in balance:
        found.append((first, nn.Sequential(*[model[i] for i in range(first, first + count)])))
        first += count
    return found


def build_chunks(
    model: nn.Sequential,
    balance: Sequence[int],
    schedule: Schedule,
    devices: Sequence[torch.device],
    stages: Sequence[int],
    make_chunk: Callable[[ChunkSpec, nn.Sequential, torch.device], Chunk],
) -> dict[int, Chunk]:
    """Move each chunk of the listed stages onto its stage's device and wrap it, with the
    ``ChunkSpec`` that says where it sits (made here only).

    Args:
        model: the whole model; its modules are shared, not copied.
        balance: layers per chunk (``schedule.chunks`` entries).
        schedule: gives each chunk's stage (``placement``).
        devices: one device per stage.
        stages: the stages to build (all of them in one process, one per rank).
        make_chunk: ``make_chunk(spec, layers, device)`` -> chunk.
    """
    built: dict[int, Chunk] = {}
    last = schedule.chunks - 1
    for index, (first, layers) in enumerate(slices(model, balance)):
        stage = schedule.placement[index]
        if stage in stages:
            layers.to(devices[stage])
            spec = ChunkSpec(index, stage, first, index == 0, index == last)
            built[index] = make_chunk(spec, layers, devices[stage])
    return built
