"""A fresh process that builds, steps and closes a CPU Pipe, then frees 1 GiB of its own
tensors and reads its resident memory; then opts in to kept pages and does it again. Run as
a script, it prints what it found as JSON.

A fresh process, not a rank forked from a fork server: what glibc does with freed memory
depends on every ``mallopt`` the process made and on what it allocated and freed before,
and a fresh interpreter's history is only its imports.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from pipeline import Pipe, keep_freed_pages

TOTAL = 1 << 30  # what each round allocates, all of it alive at once
EACH = 4 << 20  # per tensor: far above glibc's default mmap threshold (128 KiB)
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident set, from ``/proc/self/statm`` (its second field, in pages)."""
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * PAGE


def allocate_and_free() -> int:
    """``TOTAL`` bytes of tensors in ``EACH``-byte pieces, every page touched, then freed:
    the resident bytes while they were alive."""
    pieces = [torch.ones(EACH // 4) for _ in range(TOTAL // EACH)]
    alive = resident_bytes()
    del pieces
    return alive


def after_a_cpu_pipe() -> dict[str, object]:
    """Resident bytes before, during and after a round, once after a Pipe was built,
    stepped and closed, and once more after ``keep_freed_pages()``."""
    with Pipe(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), chunks=2,
              balance=[2, 1], devices=["cpu", "cpu"], loss_fn=nn.MSELoss()) as pipe:
        pipe.step(torch.randn(8, 8), torch.randn(8, 8))
    asked_by_the_pipe = keep_freed_pages.cache_info().currsize == 1
    rounds = {}
    for name in ("plain", "kept"):
        if name == "kept":
            rounds["applied"] = keep_freed_pages()
        before = resident_bytes()
        alive = allocate_and_free()
        rounds[name] = {"before": before, "alive": alive, "after": resident_bytes()}
    return {"asked_by_the_pipe": asked_by_the_pipe, **rounds}


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(after_a_cpu_pipe()))
