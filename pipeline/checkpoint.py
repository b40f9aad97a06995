"""Activation recomputation modes and the per-micro-batch RNG that makes them exact.

Why it is built this way: a stage that recomputes a forward right before its
backward must see the very same random numbers (dropout masks) that the first
forward saw, or the gradients belong to a different network. Saving and
restoring the global RNG state around each forward is not enough when several
stages run as threads in one process: they share the CPU generator (and a GPU
generator per device), so the state a forward sees would depend on thread
timing. Instead every (chunk, micro-batch) forward runs under its own seed,
derived from one number drawn per step from the caller's generator; the
recomputation reuses that seed. Results then depend neither on timing nor on
the recomputation mode, and the same global seed gives the same step twice.
Forwards of chunks that draw random numbers take a per-device lock while they
run, because the generator itself is shared; chunks without stochastic layers
never touch it and run unlocked.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Literal

import torch
from torch import nn

CheckpointMode = Literal["always", "except_last", "never"]
CHECKPOINT_MODES: tuple[str, ...] = ("always", "except_last", "never")

_STOCHASTIC = (nn.modules.dropout._DropoutNd, nn.RReLU)


def check_mode(mode: str) -> CheckpointMode:
    """Return ``mode`` if it is a known checkpoint mode, else raise ValueError."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(
            f"unknown checkpoint mode {mode!r}; expected one of: {', '.join(CHECKPOINT_MODES)}"
        )
    return mode  # type: ignore[return-value]


def recomputes(mode: CheckpointMode, microbatch: int, microbatches: int) -> bool:
    """Whether a micro-batch's forward keeps only its input and is recomputed for backward."""
    if mode == "always":
        return True
    if mode == "except_last":
        return microbatch != microbatches - 1
    return False


def is_stochastic(module: nn.Module) -> bool:
    """Whether a module (or a submodule) draws random numbers in training mode.

    ``Dropout(p=0)`` (as in many ``TransformerEncoderLayer``s) draws none.
    """
    return any(
        isinstance(m, _STOCHASTIC) and m.training and getattr(m, "p", 1.0) > 0
        for m in module.modules()
    )


def step_seed() -> int:
    """One number drawn from the default generator: the base of a step's seeds."""
    return int(torch.randint(0, 2**62, (1,)).item())


def microbatch_seed(base: int, chunk: int, microbatch: int) -> int:
    """The seed of one (chunk, micro-batch) forward within a step."""
    return (base * 1_000_003 + chunk * 10_007 + microbatch) % (2**63 - 1)


@contextmanager
def seeded(device: torch.device, seed: int | None, lock: threading.Lock | None) -> Iterator[None]:
    """Run the body under ``seed`` on ``device``'s generator, restoring it afterwards.

    ``seed=None`` means the body draws no random numbers: nothing is forked.
    """
    if seed is None:
        yield
        return
    cuda = [device] if device.type == "cuda" else []
    with lock if lock is not None else nullcontext(), torch.random.fork_rng(devices=cuda):
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        else:
            torch.random.default_generator.manual_seed(seed)
        yield
