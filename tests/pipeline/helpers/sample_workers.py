"""Rank functions for tests/pipeline/setup/test_samples_agree.py (importable by name)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline import Pipe

UNITS = str(Path(__file__).resolve().parents[2] / "units")  # traced_models, by its bare name
if UNITS not in sys.path:
    sys.path.insert(0, UNITS)

from traced_models import Looped, looped_batch, mse  # noqa: E402

TIMEOUT = 30.0  # a rank that hangs fails the case, not the suite


def _other_rows(rank: int) -> Any:
    return looped_batch(rows=4 if rank == 0 else 6)[0]


def _other_key(rank: int) -> Any:
    batch = looped_batch(rows=4)[0]
    return batch if rank == 0 else {"x": batch["x"], "scale": batch["weight"]}


def _other_dtype(rank: int) -> Any:
    batch = looped_batch(rows=4)[0]
    return batch if rank == 0 else {**batch, "weight": batch["weight"].float()}


CASES = {"rows": _other_rows, "key": _other_key, "dtype": _other_dtype}


def _built(sample: Any) -> str:
    """``ok``, or the ValueError that ``Pipe(Looped(), sample=sample)`` raised."""
    try:
        Pipe(Looped(), chunks=2, sample=sample, group=dist.group.WORLD, loss_fn=mse,
             timeout=TIMEOUT).close()
    except ValueError as error:
        return str(error)
    return "ok"


def samples_on_ranks(rank: int, world: int) -> dict[str, Any]:
    """Each disagreeing case's outcome on this rank; then one step on the same sample
    everywhere (the loss), and an nn.Sequential whose ranks pass different samples."""
    torch.set_num_threads(1)
    found: dict[str, Any] = {name: _built(sample_of(rank)) for name, sample_of in CASES.items()}
    batch, target = looped_batch(rows=4)
    with Pipe(Looped(), chunks=2, sample=batch, group=dist.group.WORLD, loss_fn=mse,
              timeout=TIMEOUT) as pipe:
        found["same"] = float(pipe.step(batch, target))
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    with Pipe(layers, chunks=2, sample=batch["x"] if rank == 0 else None,
              group=dist.group.WORLD, timeout=TIMEOUT):
        found["sequential"] = "ok"
    return found
