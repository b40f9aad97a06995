"""What a Pipe's ranks decide together: rank 0's plan or balance for all, a shared overflow.

In one process (``group=None``) each helper simply does the work here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist

from pipeline.compute.recompute import CHECKPOINT_MODES, check_mode
from pipeline.group.collectives import all_reduce, broadcast_object
from pipeline.setup.options import check_positive

if TYPE_CHECKING:
    from schedules import Link

T = TypeVar("T")


def on_rank_zero(work: Callable[[], T], group: dist.ProcessGroup | None, timeout: float,
                 what: str) -> T:
    """``work()`` run on rank 0 of ``group`` (or here, without one), its result on every rank.

    Rank 0's failure reaches every rank, so that no rank waits for a result that will
    never come: rank 0 raises its own error, the others a ValueError naming it.
    """
    if group is None:
        return work()
    from pipeline.group.process_groups import rank_device

    decided: tuple[T | None, str | None] = (None, None)
    error: BaseException | None = None
    if dist.get_rank(group) == 0:
        try:
            decided = (work(), None)
        except Exception as failure:  # raised below, on every rank
            error = failure
            decided = (None, f"{type(failure).__name__}: {failure}")
    decided = broadcast_object(decided, 0, group, timeout, f"sharing rank 0's {what}",
                               rank_device(group))
    if error is not None:
        raise error
    if decided[1] is not None:
        raise ValueError(f"rank 0 failed in {what}: {decided[1]}")
    return cast(T, decided[0])  # rank 0's work() result, as it crossed


def choose_plan(model: Any, chunks: Any, schedule: Any, checkpoint: Any, stages: int,
                samples: tuple[Any, Any, Any], devices: Sequence[torch.device],
                memory_limit: float | None, group: dist.ProcessGroup | None, timeout: float) -> Any:
    """The ``partitioners.Plan`` for ``chunks="auto"`` / ``schedule="auto"``, the same on every
    rank: what is fixed (a count, a schedule name, a checkpoint mode) is kept. ``samples``
    is (a batch, its target or None, the loss function or None): with both of the last
    two, the loss is profiled too."""
    sample, target, loss_fn = samples
    from partitioners import plan_for_model

    if not isinstance(schedule, str):
        raise ValueError(
            f"schedule='auto' or a name with chunks='auto', got a {type(schedule).__name__}"
        )

    hop = _calibrated_hop(stages, devices, group, timeout)  # every rank takes part

    def make() -> Any:
        from pipeline.predict.overheads import action_overhead

        if sample is None:
            raise ValueError(
                "chunks='auto' or schedule='auto' needs a batch to profile: pass sample=x "
                "(with a group: on rank 0, which plans for every rank)"
            )
        first = sample[0] if isinstance(sample, list) else sample
        with_loss = target is not None and loss_fn is not None
        return plan_for_model(
            model, first, target if with_loss else None, loss_fn if with_loss else None,
            stages=stages, memory_limit=memory_limit, devices=list(devices)[:1],
            hop=hop, action_overhead=action_overhead(devices[0]),
            microbatch_counts=None if chunks == "auto" else [check_positive("chunks", chunks)],
            schedules=None if schedule == "auto" else [schedule],
            checkpoints=CHECKPOINT_MODES if checkpoint in (None, "auto")
            else (check_mode(checkpoint),),
        )

    return on_rank_zero(make, group, timeout, "planning")


def _calibrated_hop(stages: int, devices: Sequence[torch.device], group: dist.ProcessGroup | None,
                    timeout: float) -> Link | None:
    """The hop between the first two stages, calibrated as ``Pipe.predict``'s is (a ping-pong
    across ranks, or between two stage threads), taken for every pair: a ``schedules.Link``,
    or None with one stage."""
    from pipeline.group.links import calibrate_group, calibrate_local
    from schedules import get_schedule

    if stages < 2:
        return None
    chain = get_schedule("1f1b", stages=stages, microbatches=stages)
    if group is None:
        hops = calibrate_local(list(devices), chain, timeout)
    else:
        hops = calibrate_group(group, chain, devices[0], timeout)
    return hops.link(0, 1)


def share_overflow(parameters: Iterable[torch.nn.Parameter], group: dist.ProcessGroup,
                   timeout: float) -> None:
    """An inf or NaN gradient on one rank becomes one on every rank, so that a GradScaler
    skips the same step everywhere."""
    from pipeline.group.process_groups import rank_device

    grads = [p.grad for p in parameters if p.grad is not None]
    found = any(not bool(torch.isfinite(g).all()) for g in grads)
    flag = torch.tensor([float(found)], device=rank_device(group))
    all_reduce(flag, group, timeout, "sharing a gradient overflow", dist.ReduceOp.MAX)
    if float(flag) and not found and grads:
        grads[0].view(-1)[0] = float("inf")
