"""Activation recomputation ("checkpoint") modes, and which micro-batches each recomputes.

One rule for the simulator (``schedules.costs``), the planner
(``partitioners.plan.costs``) and the runtime (``pipeline.compute.recompute``):

- ``"never"``: every forward keeps what its backward needs;
- ``"except_last"``: every micro-batch but the step's last keeps only its input and
  recomputes its forward before its backward (the last one's backward follows at once);
- ``"always"``: every micro-batch is recomputed.
"""

from __future__ import annotations

from typing import Literal

CheckpointMode = Literal["never", "except_last", "always"]

CHECKPOINT_MODES: tuple[CheckpointMode, ...] = ("never", "except_last", "always")
"""From the least recomputation to the most: the planner breaks ties in this order."""


def check_mode(mode: object) -> CheckpointMode:
    """Return ``mode`` if it is a known checkpoint mode, else raise ValueError naming them."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(
            f"unknown checkpoint mode {mode!r}; expected one of: {', '.join(CHECKPOINT_MODES)}"
        )
    return mode  # narrowed by the check above


def recomputes(mode: CheckpointMode, microbatch: int, microbatches: int) -> bool:
    """Whether micro-batch ``microbatch`` of ``microbatches`` is recomputed under ``mode``."""
    if mode == "always":
        return True
    if mode == "except_last":
        return microbatch != microbatches - 1
    return False


def recomputed(mode: CheckpointMode, microbatches: int) -> tuple[bool, ...]:
    """One bool per micro-batch: is its forward recomputed under ``mode``."""
    return tuple(recomputes(mode, m, microbatches) for m in range(microbatches))
