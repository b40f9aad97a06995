"""Timeline and Event: what ran where and when, predicted or measured, and its figures."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, reduce
from itertools import accumulate
from operator import add, attrgetter, sub
from pathlib import Path
from typing import Any

from schedules._speed import gc_paused
from schedules.action import Action, Op
from schedules.events import Event, Events, StageColumns
from schedules.vocabulary import OP_CODES

__all__ = ["Event", "MemoryTrace", "Timeline"]

# Per op code, the change in held activations plus one (so that it is a byte): a forward
# takes one (+1), a B or W frees one (-1), an I neither: a stage's peak is a running sum.
_HELD_PLUS_ONE = bytes.maketrans(
    bytes(OP_CODES[op] for op in (Op.F, Op.B, Op.I, Op.W)), bytes((2, 0, 1, 0)))


@dataclass(frozen=True)
class MemoryTrace:
    """The bytes one stage holds over a step, a step function.

    ``held[i]`` bytes from ``times[i]`` until ``times[i + 1]`` (the last value
    until the end of the step).

    Attributes:
        times: increasing instants, the first at the timeline's start.
        held: bytes held from each instant on.
    """

    times: tuple[float, ...]
    held: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.times) != len(self.held) or not self.times:
            raise ValueError(f"MemoryTrace: expected as many held values as times (>= 1), "
                             f"got {len(self.held)} and {len(self.times)}")

    @cached_property
    def peak(self) -> float:
        """The most bytes held at once."""
        return max(self.held)

    def at(self, time: float) -> float:
        """Bytes held at ``time`` (the value from the latest instant <= ``time``)."""
        return self.held[max(bisect_right(self.times, time) - 1, 0)]


@dataclass(frozen=True)
class Timeline:
    """The events of one pipeline step, simulated by ``simulate`` or measured by ``Pipe``.

    Attributes:
        stages: number of stages (rows of the plot).
        events: every action's event, in no particular order: a tuple of Events, or,
            from ``simulate`` (``from_columns``), ``Events``, arrays that read as that
            tuple (stage after stage, each in its order), the figures read on the arrays.
        chunks_per_stage: how many model chunks each stage holds; an activation of
            one chunk counts ``1 / chunks_per_stage[stage]`` of a full stage's.
        name: what to call it in titles (``"1f1b (simulated)"``, say).
        makespan_bound: for a simulated timeline, the physical lower bound on the
            makespan (no stage can start before the first micro-batch has crossed
            the stages before it); ``None`` for a measured one.
        memory: per stage, the bytes held over time, when predicted (``simulate``
            with ``Costs.activation_bytes``); empty otherwise.
    """

    stages: int
    events: tuple[Event, ...]
    chunks_per_stage: tuple[int, ...] = ()
    name: str = ""
    makespan_bound: float | None = None
    memory: tuple[MemoryTrace, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.events, Events):  # Events are already an immutable sequence
            object.__setattr__(self, "events", tuple(self.events))
        if not self.chunks_per_stage:
            object.__setattr__(self, "chunks_per_stage", (1,) * self.stages)
        object.__setattr__(self, "memory", tuple(self.memory))
        if self.memory and len(self.memory) != self.stages:
            raise ValueError(f"Timeline memory: expected one trace per stage ({self.stages}), "
                             f"got {len(self.memory)}")

    @cached_property
    def start(self) -> float:
        columns = self._columns
        if columns is not None:
            return min((min(stage.starts) for stage in columns if stage.starts), default=0.0)
        return min((event.start for event in self.events), default=0.0)

    @cached_property
    def makespan(self) -> float:
        """Time from the first action's start to the last action's end."""
        columns = self._columns
        if columns is not None:
            last = max((max(stage.ends) for stage in columns if stage.ends), default=0.0)
            return last - self.start
        return max((event.end for event in self.events), default=0.0) - self.start

    @cached_property
    def busy(self) -> tuple[float, ...]:
        """Per stage, the time spent running actions."""
        columns = self._columns
        if columns is not None:  # summed left to right, in the events' order, as below
            return tuple(reduce(add, map(sub, stage.ends, stage.starts), 0.0)
                         for stage in columns)
        totals = [0.0] * self.stages
        for event in self.events:
            totals[event.stage] += event.duration
        return tuple(totals)

    @property
    def _columns(self) -> tuple[StageColumns, ...] | None:
        """Each stage's arrays, when the events are stored as arrays (``simulate``'s)."""
        events = self.events
        if isinstance(events, Events) and len(events.columns) == self.stages:
            return events.columns
        return None

    @property
    def idle(self) -> tuple[float, ...]:
        """Per stage, the time within the makespan spent waiting."""
        return tuple(self.makespan - busy for busy in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Idle stage-time over ``stages x makespan``."""
        if self.makespan == 0:
            return 0.0
        return sum(self.idle) / (self.stages * self.makespan)

    @property
    def bubble_bound(self) -> float | None:
        """The smallest bubble fraction any order could reach with these costs, if known."""
        if self.makespan_bound is None or self.makespan_bound == 0:
            return None
        return 1.0 - sum(self.busy) / (self.stages * self.makespan_bound)

    @property
    def peak_bytes(self) -> tuple[float, ...] | None:
        """Per stage, the most bytes held at once, when ``memory`` was predicted; else None."""
        if not self.memory:
            return None
        return tuple(trace.peak for trace in self.memory)

    @classmethod
    def from_columns(cls, columns: Sequence[StageColumns], **fields: Any) -> Timeline:
        """A Timeline from each stage's events as arrays, in the order they ran (as
        ``simulate`` has them): no Event is made until one is read, and ``stage_events``
        needs no sort. The caller vouches for the order.

        Args:
            columns: per stage, its actions with their starts and ends, in order.
            fields: the other fields (``chunks_per_stage``, ``name``, ...).
        """
        return cls(stages=len(columns), events=Events(columns), **fields)

    @cached_property
    def _by_stage(self) -> tuple[tuple[Event, ...], ...]:
        events = self.events
        if self._columns is not None and isinstance(events, Events):
            return tuple(events.stage(stage) for stage in range(self.stages))
        # One pass to group, then a stable sort per stage (linear on the simulator's
        # already ordered events): stage_events for every stage costs O(events).
        groups: list[list[Event]] = [[] for _ in range(self.stages)]
        by_time = attrgetter("start", "end")
        with gc_paused():  # the sort keys are 10^6 tuples: no cycles, only GC passes
            for event in self.events:
                groups[event.stage].append(event)
            return tuple(tuple(sorted(group, key=by_time)) for group in groups)

    def stage_events(self, stage: int) -> tuple[Event, ...]:
        """The events of one stage, in the order they started."""
        return self._by_stage[stage]

    def stage_order(self, stage: int) -> tuple[Action, ...]:
        """The actions one stage ran, in the order it ran them."""
        columns = self._columns
        if columns is not None:
            return columns[stage].order
        return tuple(event.action for event in self.stage_events(stage))

    @cached_property
    def peak_activations(self) -> tuple[float, ...]:
        """Per stage, the most micro-batches whose activations it held at once.

        A micro-batch's activations on a chunk are held from the start of its
        forward to the end of its last backward action (``B``, or ``W`` when the
        backward is split). A chunk of a stage holding v chunks counts 1/v.
        """
        with gc_paused():  # the sets below hold 10^6 small tuples
            return self._peak_activations()

    def _peak_activations(self) -> tuple[float, ...]:
        columns = self._columns
        if columns is not None:
            return tuple(round(_peak_held(stage.order.ops) / chunks, 9)
                         for stage, chunks in zip(columns, self.chunks_per_stage))
        forward, weight, full = Op.F, Op.W, Op.B
        peaks = []
        for stage, events in enumerate(self._by_stage):
            # Count whole chunk activations (exact integers) and share them at the end.
            # A (micro-batch, chunk) has either B or I and W, never both, so any B or W
            # is the last backward action.
            held = peak = 0
            for event in events:
                op = event.action.op
                if op is forward:
                    held += 1
                    if held > peak:
                        peak = held
                elif op is weight or op is full:
                    held -= 1
            peaks.append(round(peak / self.chunks_per_stage[stage], 9))
        return tuple(peaks)

    def to_chrome_trace(self, path: str | os.PathLike[str]) -> Path:
        """Write the timeline as Chrome trace JSON (chrome://tracing, Perfetto): a row per stage.

        The file is written to a temporary name in the same folder and renamed, so
        it is never half written; the temporary file is removed if anything fails.

        Args:
            path: the file to write (replaced if it exists).

        Returns:
            ``path`` as a Path.

        Raises:
            ValueError: an event with a time that is not finite (JSON has no
                Infinity or NaN).
            OSError: the file cannot be written (nothing is left behind).
        """
        for event in self.events:
            if not (math.isfinite(event.start) and math.isfinite(event.end)):
                raise ValueError(
                    f"to_chrome_trace: expected finite event times, got {event.action} on "
                    f"stage {event.stage} from {event.start} to {event.end}"
                )
        trace: list[dict[str, object]] = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": stage,
             "args": {"name": f"stage {stage}"}}
            for stage in range(self.stages)
        ]
        for event in sorted(self.events, key=lambda e: (e.stage, e.start)):
            trace.append({
                "name": str(event.action),
                "cat": event.action.op.name,
                "ph": "X",
                "pid": 0,
                "tid": event.stage,
                "ts": (event.start - self.start) * 1e6,
                "dur": event.duration * 1e6,
                "args": {"microbatch": event.action.microbatch, "chunk": event.action.chunk},
            })
        target = Path(path)
        _write_atomically(target, {"traceEvents": trace, "displayTimeUnit": "ms"})
        return target


def _peak_held(ops: bytes) -> int:
    """The most activations held at once by a stage running ``ops`` (op codes) in order."""
    # The running sum of (change + 1) less the count of actions is the running held count.
    held = map(sub, accumulate(ops.translate(_HELD_PLUS_ONE)), range(1, len(ops) + 1))
    return max(0, max(held, default=0))


def _write_atomically(target: Path, document: object) -> None:
    """Dump ``document`` as JSON next to ``target`` and rename it there; clean up on failure."""
    handle = tempfile.NamedTemporaryFile(
        "w", dir=target.parent, prefix=f".{target.name}.", suffix=".tmp", delete=False
    )
    try:
        with handle:
            json.dump(document, handle, allow_nan=False)
        os.replace(handle.name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(handle.name)
        raise
