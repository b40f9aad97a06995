"""A rank's own action times of its last steps, gathered on the first rank only when asked.

Rank 0 used to gather every rank's events after every step and keep five whole
timelines: at 64 ranks, 64 ranks' events of five steps held as Python objects on one
rank (each full garbage collection scans them), and a gather a step that nobody may
read. Here each rank keeps only its own stage's start and end times of its last
``RECENT_STEPS`` steps, as one float64 row a step (its schedule order says which action
each pair is), and sends them when the whole timeline is needed: the first read of
``pipe.timeline`` after a step, ``predict()`` (which refines itself from the recent
steps) or ``close()``. A gather sends the rows no gather has sent yet, at most
``RECENT_STEPS``, to the first rank (one ``gather``, not an all-gather: nobody else
keeps them); the first rank keeps them as tensors and builds a ``Timeline`` only when
one is read.

Every rank of the pipeline counts the same steps and takes part in the same gathers,
so the number of rows is the same on every rank; the first rank checks that the steps
its peers sent are its own.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from schedules import Event, Schedule, Timeline

from pipeline.group.collectives import wait
from pipeline.runtime.runner import RECENT_STEPS, PendingTimeline, measured_timeline

_HEADER = 2  # a row: the step's number, its start on the first stage's clock, then the times


class StepTimes:
    """This stage's action times of the last ``RECENT_STEPS`` steps; every stage's on the
    first rank once gathered.

    Attributes:
        gathers: how many gathers this rank took part in (one per ``gather`` that sent rows).
    """

    def __init__(self, schedule: Schedule, stage: int, group: dist.ProcessGroup,
                 device: torch.device, timeout: float, clock_offset: float) -> None:
        self.schedule = schedule
        self.stage = stage
        self.group = group
        self.device = device
        self.timeout = timeout
        self.clock_offset = clock_offset
        self.width = _HEADER + 2 * max(len(order) for order in schedule.order)
        self.steps = 0  # steps recorded, counted alike on every rank
        self.gathered_through = 0  # the last step a gather sent
        self.gathers = 0
        self.halted = False  # no collective after close or a failed step: the group may be gone
        self._own: collections.deque[torch.Tensor] = collections.deque(maxlen=RECENT_STEPS)
        # On the first rank: step -> every stage's row of it (stages x width), recent only.
        self._whole: dict[int, torch.Tensor] = {}

    def record(self, events: list[Event], origin: float) -> PendingTimeline:
        """Keep this stage's times of the step that began at ``origin``; the step's Timeline,
        gathered when it is first asked for."""
        self.steps += 1
        row = torch.zeros(self.width, dtype=torch.float64)
        shift = self.clock_offset  # to the first stage's clock
        row[0], row[1] = self.steps, origin - shift
        if events:
            row[_HEADER: _HEADER + 2 * len(events)] = torch.tensor(
                [t - shift for event in events for t in (event.start, event.end)],
                dtype=torch.float64)
        self._own.append(row)
        step = self.steps
        return PendingTimeline(lambda: self.timeline(step))

    def pending(self) -> int:
        """Rows no gather has sent yet (at most ``RECENT_STEPS``), the same on every rank."""
        return min(self.steps - self.gathered_through, len(self._own))

    def gather(self) -> None:
        """Send the rows no gather sent yet to the first rank (a collective of the pipeline's
        ranks; nothing when there are none).

        Raises:
            PeerError: a rank did not take part within the timeout.
            RuntimeError: a rank sent other steps than this rank's (their calls differ).
        """
        count = self.pending()
        if count == 0 or self.halted:
            return
        rows = torch.stack(list(self._own)[-count:]).to(self.device)
        first = self.stage == 0
        received = [torch.empty_like(rows) for _ in range(self.schedule.stages)] if first else None
        work = dist.gather(rows, received, group=self.group, group_dst=0, async_op=True)
        self.gathered_through = self.steps
        self.gathers += 1
        try:
            wait(work, "gathering the recent steps' timelines (every rank reads pipe.timeline, "
                 "or calls predict() or close())", self.group, self.timeout)
        except BaseException:
            self.halted = True
            raise
        if received is None:
            return
        parts = [part.cpu() for part in received]
        for index in range(count):
            steps = {int(part[index][0]) for part in parts}
            if len(steps) != 1:
                raise RuntimeError(f"the ranks sent the times of different steps {sorted(steps)} "
                                   f"for one timeline: their calls to step() differ")
            self._whole[steps.pop()] = torch.stack([part[index] for part in parts])
        for step in [s for s in self._whole if s <= self.steps - RECENT_STEPS]:
            del self._whole[step]

    def timeline(self, step: int) -> Timeline | None:
        """Step ``step``'s whole Timeline on the first rank (gathering it if no gather sent
        it yet), None on the others, or when it is gone (older than the recent steps, or
        not gathered before close or a failure)."""
        if step > self.gathered_through:
            self.gather()
        rows = self._whole.get(step)
        if rows is None:
            return None
        schedule = self.schedule
        start = float(rows[0][1])
        events = [
            Event(stage, action, begin - start, end - start)
            for stage, row in enumerate(rows)
            for action, (begin, end) in zip(schedule.order[stage],
                                            row[_HEADER:].view(-1, 2).tolist())
        ]
        return measured_timeline(schedule, events, f"measured, {schedule.stages} ranks")

    def recent(self) -> tuple[Timeline, ...]:
        """The last steps' whole Timelines on the first rank (gathering what was not), oldest
        first; empty on the others."""
        self.gather()
        found = (self.timeline(step) for step in sorted(self._whole))
        return tuple(timeline for timeline in found if timeline is not None)
