"""What a Pipe shows its user: its layout, schedule, plan, units, timelines and memory.

Mixed into ``Pipe`` beside ``ModelLike``: read-only views of what the Pipe decided at
build and measured in its steps, and the switch that measures activation memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from schedules import Schedule, Timeline
from units import Cut, UnitInfo
from units.ep_dispatch import Exchange, ExchangeCounts
from units.tp_graph import Counts

from pipeline.compute.activations import MemoryReport
from pipeline.group.distributed import Distributed
from pipeline.group.ranks import Ranks
from pipeline.runtime.runner import PendingTimeline, Runner


class PipeViews:
    """Mixed into ``Pipe``: the properties users read."""

    cut: Cut
    _distributed: Distributed | None
    _ranks: Ranks
    _schedule: Schedule
    _plan: Any
    _balance: list[int] | None
    _devices: list[torch.device]
    _runner: Runner | None
    _timeline: Timeline | None
    _pending: PendingTimeline | None
    _measuring: int

    @property
    def distributed(self) -> Distributed | None:
        """How this Pipe runs across processes (None: in one process)."""
        return self._distributed

    @property
    def ranks(self) -> Ranks:
        """The processes this Pipe runs on (``pipeline.group.ranks``): one, or a group's."""
        return self._ranks

    @property
    def schedule(self) -> Schedule:
        """The Schedule this Pipe runs."""
        return self._schedule

    @property
    def plan(self) -> Any:
        """The ``partitioners.Plan`` picked for ``"auto"`` (None when nothing was planned)."""
        return self._plan

    @property
    def units(self) -> tuple[UnitInfo, ...]:
        """The units the model is cut into (``units.UnitInfo``: index, name, the model's
        modules and parameter names, and the chunk and stage that run it; ``pipe.balance``
        counts them): a Sequential's layers, or a traced model's pieces."""
        infos = self.cut.infos
        if self._balance is None:
            return infos
        chunk_of = [c for c, count in enumerate(self._balance) for _ in range(count)]
        return tuple(replace(info, chunk=chunk_of[info.index],
                             stage=self._schedule.placement[chunk_of[info.index]])
                     for info in infos)

    @property
    def balance(self) -> list[int] | None:
        """Layers per model chunk (None until a 'time' balance has seen its first batch)."""
        return None if self._balance is None else list(self._balance)

    @property
    def devices(self) -> list[torch.device]:
        """One device per stage (one process), or this rank's device (with a group)."""
        return list(self._devices)

    @property
    def stages(self) -> int:
        return self._schedule.stages

    @property
    def timeline(self) -> Timeline | None:
        """The measured Timeline of the last step (every rank's events on rank 0).

        With a group, each rank keeps only its own stage's times of its last few steps
        (``RECENT_STEPS``), and the whole timeline is gathered on rank 0 when it is needed:
        the first read after a step, ``predict()`` (which refines itself from the recent
        steps) and ``close()``. Reading it is then a collective, like ``step()``: every rank
        reads it (the others get None), or rank 0 reads it alone right before or after
        ``close()`` or after ``predict()``, which gather it. A run that reads it once after
        100 steps gathers once; reading it after every step gathers every step. A rank
        that leaves without ``close()`` takes its part of the unread steps with it.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            self._timeline = pending.result()
        return self._timeline

    @contextlib.contextmanager
    def measure_memory(self) -> Iterator[None]:
        """Measure the activation memory each local stage holds in the steps run inside:
        ``with pipe.measure_memory(): pipe.step(x, y)``, then ``pipe.memory``. Off
        otherwise, since it hooks every tensor autograd saves. With a group, every rank
        measures its own stage (enter it on every rank, or the ranks' steps differ only in
        their cost)."""
        self._measuring += 1  # nested blocks: measured until the outermost ends
        self._set_measuring()
        try:
            yield
        finally:
            self._measuring -= 1
            self._set_measuring()

    def _set_measuring(self) -> None:
        if self._runner is not None:
            for tracker in self._runner.trackers:
                tracker.measuring = self._measuring > 0

    @property
    def tensor_parallel_counts(self) -> Counts | None:
        """This rank's tensor-parallel all-reduces so far (calls and bytes, forward and
        backward; ``units.tp_graph.Counts``) where a traced model is split by a plan's
        names, else None."""
        boundaries = self._runner.boundaries if self._runner is not None else None
        return boundaries.counts if boundaries is not None else None

    @property
    def expert_parallel_counts(self) -> ExchangeCounts | None:
        """This rank's expert-parallel all-to-alls of token rows so far (calls and bytes,
        forward and backward, and the rows its experts computed;
        ``units.ep_dispatch.ExchangeCounts``) where experts are spread over ``ep``, else
        None."""
        exchange = self.expert_exchange
        return exchange.counts if exchange is not None else None

    @property
    def expert_exchange(self) -> Exchange | None:
        """This rank's expert-parallel token exchange (``units.ep_dispatch.Exchange``: its
        counts, and a link cost a benchmark may declare) where experts are spread over
        ``ep``, else None."""
        return self._runner.exchange if self._runner is not None else None

    @property
    def memory(self) -> tuple[MemoryReport, ...]:
        """Per local stage, the activation memory it held at most during the last step run
        inside ``measure_memory()``.

        Raises:
            ValueError: no step has run inside ``measure_memory()``.
        """
        memory = self._runner.memory if self._runner is not None else ()
        if not memory:
            raise ValueError(
                "pipe.memory holds the activation memory of steps run inside "
                "`with pipe.measure_memory():`, and no step has run inside one (it is measured "
                "only when asked for: it hooks every tensor autograd saves)"
            )
        return memory
