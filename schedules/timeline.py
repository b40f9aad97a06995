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
from functools import cached_property
from itertools import chain
from operator import attrgetter
from pathlib import Path
from typing import Any

from schedules._speed import gc_paused
from schedules.action import Action, Op


@dataclass(frozen=True)
class Event:
    """One action run on one stage from ``start`` to ``end`` (seconds, or cost units)."""

    stage: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


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
        events: every action's event, in no particular order.
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
        object.__setattr__(self, "events", tuple(self.events))
        if not self.chunks_per_stage:
            object.__setattr__(self, "chunks_per_stage", (1,) * self.stages)
        object.__setattr__(self, "memory", tuple(self.memory))
        if self.memory and len(self.memory) != self.stages:
            raise ValueError(f"Timeline memory: expected one trace per stage ({self.stages}), "
                             f"got {len(self.memory)}")

    @cached_property
    def start(self) -> float:
        return min((event.start for event in self.events), default=0.0)

    @cached_property
    def makespan(self) -> float:
        """Time from the first action's start to the last action's end."""
        return max((event.end for event in self.events), default=0.0) - self.start

    @cached_property
    def busy(self) -> tuple[float, ...]:
        """Per stage, the time spent running actions."""
        totals = [0.0] * self.stages
        for event in self.events:
            totals[event.stage] += event.duration
        return tuple(totals)

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
    def _from_stage_events(cls, per_stage: Sequence[Sequence[Event]], **fields: Any) -> Timeline:
        """A Timeline from each stage's events in the order they ran, as ``simulate`` has
        them: ``stage_events`` then needs no sort. The caller vouches for the order."""
        timeline = cls(stages=len(per_stage), events=tuple(chain.from_iterable(per_stage)),
                       **fields)
        timeline.__dict__["_by_stage"] = tuple(tuple(events) for events in per_stage)
        return timeline

    @cached_property
    def _by_stage(self) -> tuple[tuple[Event, ...], ...]:
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
