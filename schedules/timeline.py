"""Timeline and Event: what ran where and when, predicted or measured, and its figures."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

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
    """

    stages: int
    events: tuple[Event, ...]
    chunks_per_stage: tuple[int, ...] = ()
    name: str = ""
    makespan_bound: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(self.events))
        if not self.chunks_per_stage:
            object.__setattr__(self, "chunks_per_stage", (1,) * self.stages)

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

    def stage_events(self, stage: int) -> tuple[Event, ...]:
        """The events of one stage, in the order they started."""
        return tuple(
            sorted((e for e in self.events if e.stage == stage), key=lambda e: (e.start, e.end))
        )

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
        peaks = []
        for stage in range(self.stages):
            events = self.stage_events(stage)
            split = {(e.action.microbatch, e.action.chunk) for e in events if e.action.op is Op.W}
            share = 1.0 / self.chunks_per_stage[stage]
            held = peak = 0.0
            for event in events:
                action = event.action
                key = (action.microbatch, action.chunk)
                if action.op is Op.F:
                    held += share
                    peak = max(peak, held)
                elif action.op is Op.W or (action.op is Op.B and key not in split):
                    held -= share
            peaks.append(round(peak, 9))
        return tuple(peaks)

    def to_chrome_trace(self, path: str | os.PathLike[str]) -> Path:
        """Write the timeline as Chrome trace JSON (chrome://tracing, Perfetto): a row per stage.

        The file is written to a temporary name and renamed, so it is never half written.
        """
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
        with tempfile.NamedTemporaryFile(
            "w", dir=target.parent or ".", suffix=".tmp", delete=False
        ) as handle:
            json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, handle)
        os.replace(handle.name, target)
        return target
