"""A rank that builds a CPU Pipe, then counts the page faults of allocations that repeat."""

from __future__ import annotations

import resource

import torch
from torch import nn

from pipeline import Pipe
from pipeline.runtime.freed_pages import keep_freed_pages


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _allocate_and_free(bytes_each: int) -> None:
    """Buffers kept while others come and go (what I keeps for W), then all freed."""
    kept = [torch.ones(bytes_each // 4) for _ in range(8)]
    passing = [torch.ones(bytes_each // 4) for _ in range(8)]
    del passing, kept


def faults_after_a_cpu_pipe(rank: int, world: int) -> dict[str, object]:
    """Whether a CPU Pipe kept freed pages, and the faults of a third round of 16 buffers of
    1 MiB and of 8 MiB (pages touched: 4096 and 32768)."""
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=2, balance=[1, 1],
                devices=["cpu", "cpu"])
    pipe(torch.randn(4, 4)).sum().backward()
    faults = {}
    for bytes_each in (1 << 20, 8 << 20):
        for _ in range(2):
            _allocate_and_free(bytes_each)
        before = _faults()
        _allocate_and_free(bytes_each)
        faults[bytes_each] = _faults() - before
    return {"kept": keep_freed_pages(), "faults": faults}
