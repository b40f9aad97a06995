"""Who runs a Pipe: one process holding every stage, or the ranks of a process group.

Everything that differs between the two, apart from how steps run (the runners'
job), is asked of a ``Ranks``: deciding once for all (rank 0 decides, the others
receive), gathering a value from each, sharing a gradient overflow, the hops
between stages (calibrated the first time ``predict`` or a plan asks, then kept),
measuring how stages contend for cores. ``pipeline.runtime.build.processes`` picks the
kind once, with the runner that goes with it; nothing else asks whether there is a group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import torch
import torch.distributed as dist

from pipeline.compute.dtensors import is_dtensor
from pipeline.group.collectives import all_reduce, broadcast_object, gather_objects
from pipeline.group.hops import HopModel
from pipeline.group.links import calibrate_group, calibrate_local, hop_pairs
from pipeline.group.process_groups import check_ranks_agree, rank_device
from pipeline.group.state_gather import gather_state

if TYPE_CHECKING:
    from schedules import Schedule

T = TypeVar("T")


class Ranks(Protocol):
    """The processes a Pipe runs on, and what they do together."""

    timeout: float

    @property
    def size(self) -> int:
        """How many processes take part (1 in one process)."""

    @property
    def rank(self) -> int:
        """This process's place among them."""

    @property
    def shares_cores(self) -> bool:
        """Whether stages in different processes compete for this host's cores (gloo ranks;
        not NCCL's GPU per rank, and threads of one process are not modelled)."""

    def check_agree(self, **settings: Any) -> None:
        """Raise on every rank unless all passed the same ``settings``."""

    def decide(self, work: Callable[[], T], what: str) -> T:
        """``work()`` run once (on rank 0), its result on every rank."""

    def gather(self, mine: T, what: str, device: torch.device) -> list[T]:
        """Every process's ``mine``, in rank order, on every rank."""

    def share_overflow(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Make every rank's gradients non-finite where any rank's are (a scaler then skips)."""

    def gather_state(self, local: dict[str, torch.Tensor], dst: int
                     ) -> dict[str, torch.Tensor] | None:
        """Every rank's state entries merged on rank ``dst``; None on the others."""

    def hops(self, devices: Sequence[torch.device], schedule: Schedule) -> HopModel:
        """The hops between the stages of ``schedule`` that exchange results, measured as the
        runtime sends (every rank at once) the first time they are asked for, then kept.
        ``devices``: one per stage in one process; this rank's first, with a group."""


class OneProcess:
    """Every stage in this process: each question is answered here, at once."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._hops: dict[tuple[object, ...], HopModel] = {}

    @property
    def size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0

    @property
    def shares_cores(self) -> bool:
        return False

    def check_agree(self, **settings: Any) -> None:
        return None

    def decide(self, work: Callable[[], T], what: str) -> T:
        return work()

    def gather(self, mine: T, what: str, device: torch.device) -> list[T]:
        return [mine]

    def share_overflow(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        return None

    def gather_state(self, local: dict[str, torch.Tensor], dst: int
                     ) -> dict[str, torch.Tensor] | None:
        return local

    def hops(self, devices: Sequence[torch.device], schedule: Schedule) -> HopModel:
        key = _hop_key(devices, schedule)
        if key not in self._hops:
            self._hops[key] = calibrate_local(list(devices), schedule, self.timeout)
        return self._hops[key]


class RankGroup:
    """One stage per rank of ``group``: each question is a bounded collective."""

    def __init__(self, group: dist.ProcessGroup, timeout: float) -> None:
        self.group = group
        self.timeout = timeout
        self._hops: dict[tuple[object, ...], HopModel] = {}

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def shares_cores(self) -> bool:
        return dist.get_backend(self.group) != "nccl"

    def check_agree(self, **settings: Any) -> None:
        check_ranks_agree(self.group, self.timeout, **settings)

    def decide(self, work: Callable[[], T], what: str) -> T:
        # Rank 0's failure reaches every rank, so that no rank waits for a result that
        # will never come: rank 0 raises its own error, the others a ValueError naming it.
        decided: tuple[T | None, str | None] = (None, None)
        error: BaseException | None = None
        if dist.get_rank(self.group) == 0:
            try:
                decided = (work(), None)
            except Exception as failure:  # raised below, on every rank
                error = failure
                decided = (None, f"{type(failure).__name__}: {failure}")
        decided = broadcast_object(decided, 0, self.group, self.timeout,
                                   f"sharing rank 0's {what}", rank_device(self.group))
        if error is not None:
            raise error
        if decided[1] is not None:
            raise ValueError(f"rank 0 failed in {what}: {decided[1]}")
        return cast(T, decided[0])  # rank 0's work() result, as it crossed

    def gather(self, mine: T, what: str, device: torch.device) -> list[T]:
        return gather_objects(mine, self.group, self.timeout, what, device)

    def share_overflow(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        # A sharded gradient's own shard: a DTensor's isfinite().all() would be a collective.
        grads = [p.grad.to_local() if is_dtensor(p.grad) else p.grad
                 for p in parameters if p.grad is not None]
        found = any(not bool(torch.isfinite(g).all()) for g in grads)
        flag = torch.tensor([float(found)], device=rank_device(self.group))
        all_reduce(flag, self.group, self.timeout, "sharing a gradient overflow",
                   dist.ReduceOp.MAX)
        if float(flag) and not found and grads:
            grads[0].view(-1)[0] = float("inf")

    def gather_state(self, local: dict[str, torch.Tensor], dst: int
                     ) -> dict[str, torch.Tensor] | None:
        return gather_state(local, self.group, dst, self.timeout)

    def hops(self, devices: Sequence[torch.device], schedule: Schedule) -> HopModel:
        key = _hop_key(devices[:1], schedule)
        if key not in self._hops:
            self._hops[key] = calibrate_group(self.group, schedule, devices[0], self.timeout)
        return self._hops[key]


def _hop_key(devices: Sequence[torch.device], schedule: Schedule) -> tuple[object, ...]:
    """What a calibration depends on: the devices and the pairs of stages that exchange."""
    return (tuple(str(device) for device in devices), tuple(hop_pairs(schedule)))

