"""A fresh process that builds a CPU Pipe, then counts the page faults of allocations that
repeat; run as a script, it prints what it found as JSON.

A fresh process, not a rank forked from ``run_ranks``' fork server: what glibc does with
freed memory under its own dynamic thresholds depends on everything the process allocated
and freed before, and a fresh interpreter's history is only its imports.
"""

from __future__ import annotations

import json
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


def faults_after_a_cpu_pipe() -> dict[str, object]:
    """Whether a CPU Pipe asked glibc to keep freed pages and glibc now does, and the faults of rounds of 16 buffers of 1 MiB
    and of 8 MiB (pages touched: 4096 and 32768): the fewer of two rounds after two more."""
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=2, balance=[1, 1],
                devices=["cpu", "cpu"])
    pipe(torch.randn(4, 4)).sum().backward()
    asked = keep_freed_pages.cache_info().currsize == 1  # by the Pipe: nothing else calls it
    faults = {}
    for bytes_each in (1 << 20, 8 << 20):
        for _ in range(2):
            _allocate_and_free(bytes_each)
        rounds = []
        for _ in range(2):
            before = _faults()
            _allocate_and_free(bytes_each)
            rounds.append(_faults() - before)
        faults[str(bytes_each)] = min(rounds)
    return {"asked": asked, "kept": keep_freed_pages(), "faults": faults}


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(faults_after_a_cpu_pipe()))
