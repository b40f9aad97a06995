"""Events, and a timeline's events stored as arrays per stage, read as Events when asked.

``simulate`` at 64 stages predicts 10^5 to 10^6 events. An object per event (and one per
Action inside it) made it spend more time allocating than computing, and held about a
GiB at P=128, M=4096. ``Events`` keeps, per stage, the schedule's ``StageOrder`` (op codes,
micro-batches, chunks, shared, not copied) and two float arrays (starts, ends); the
timeline's figures read the arrays, and an ``Event`` is made only when one is read.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, SupportsIndex, overload

from schedules.stage_order import StageOrder
from schedules.vocabulary import OPS, Action, new_action


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


def new_event(stage: int, action: Action, start: float, end: float) -> Event:
    """An Event from checked parts, without the frozen ``__init__``'s setattr calls."""
    event = object.__new__(Event)
    fields = event.__dict__
    fields["stage"], fields["action"], fields["start"], fields["end"] = stage, action, start, end
    return event


@dataclass(frozen=True)
class StageColumns:
    """One stage's events in the order they ran: its actions, and each one's start and end."""

    order: StageOrder
    starts: array[float]
    ends: array[float]

    def __post_init__(self) -> None:
        if not len(self.order) == len(self.starts) == len(self.ends):
            raise ValueError(f"StageColumns: expected as many starts and ends as actions "
                             f"({len(self.order)}), got {len(self.starts)} and {len(self.ends)}")


class Events(tuple[Event, ...]):
    """Every stage's events, stage after stage, each in the order it ran, as arrays.

    A tuple of ``Event`` to its readers (indexing, slicing, iteration, equality with a
    tuple of events), making each Event when asked; its own tuple storage is empty.
    ``columns[stage]`` holds the arrays, for the timeline's figures.
    """

    columns: tuple[StageColumns, ...]
    first_stage: int
    offsets: tuple[int, ...]

    def __new__(cls, columns: Sequence[StageColumns], first_stage: int = 0) -> Events:
        events = super().__new__(cls)
        fields = events.__dict__
        fields["columns"], fields["first_stage"] = tuple(columns), first_stage
        fields["offsets"] = (0, *accumulate(len(stage.order) for stage in fields["columns"]))
        return events

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Events are read-only: cannot set {name}")

    def __len__(self) -> int:
        return self.offsets[-1]

    def __bool__(self) -> bool:
        return self.offsets[-1] > 0

    def _event(self, index: int) -> Event:
        row = bisect_right(self.offsets, index) - 1
        at, columns = index - self.offsets[row], self.columns[row]
        order = columns.order
        action = new_action(OPS[order.ops[at]], order.microbatches[at], order.chunks[at])
        return new_event(self.first_stage + row, action, columns.starts[at], columns.ends[at])

    @overload
    def __getitem__(self, index: SupportsIndex) -> Event: ...

    @overload
    def __getitem__(self, index: slice[Any, Any, Any]) -> tuple[Event, ...]: ...

    def __getitem__(self, index: Any) -> Event | tuple[Event, ...]:
        if isinstance(index, slice):
            return tuple(self._event(at) for at in range(*index.indices(len(self))))
        at = index.__index__()
        if at < 0:
            at += len(self)
        if not 0 <= at < len(self):
            raise IndexError("Events index out of range")
        return self._event(at)

    def __iter__(self) -> Iterator[Event]:
        new, ops = new_action, OPS
        for stage, columns in enumerate(self.columns, self.first_stage):
            order = columns.order
            for code, microbatch, chunk, start, end in zip(
                    order.ops, order.microbatches, order.chunks, columns.starts, columns.ends):
                yield new_event(stage, new(ops[code], microbatch, chunk), start, end)

    def __reversed__(self) -> Iterator[Event]:
        return (self._event(at) for at in range(len(self) - 1, -1, -1))

    def stage(self, stage: int) -> Events:
        """One stage's events, as Events of their own."""
        return Events((self.columns[stage - self.first_stage],), stage)

    def __contains__(self, event: object) -> bool:
        return any(item == event for item in self)

    def index(self, event: Any, start: Any = 0, stop: Any = None) -> int:
        return tuple(self).index(event, start, len(self) if stop is None else stop)

    def count(self, event: Any) -> int:
        return sum(1 for item in self if item == event)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Events):
            return (len(self) == len(other) and self._stages() == other._stages()
                    and all(a.order == b.order and a.starts == b.starts and a.ends == b.ends
                            for a, b in zip(self.columns, other.columns)))
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def _stages(self) -> list[int]:
        """The stage of each column that holds events (an empty stage shows in no event)."""
        return [stage for stage, columns in enumerate(self.columns, self.first_stage)
                if columns.order]

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __lt__(self, other: tuple[Any, ...]) -> bool:
        return tuple(self) < tuple(other)

    def __le__(self, other: tuple[Any, ...]) -> bool:
        return tuple(self) <= tuple(other)

    def __gt__(self, other: tuple[Any, ...]) -> bool:
        return tuple(self) > tuple(other)

    def __ge__(self, other: tuple[Any, ...]) -> bool:
        return tuple(self) >= tuple(other)

    def __add__(self, other: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(self) + tuple(other)

    def __radd__(self, other: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(other) + tuple(self)

    def __mul__(self, times: Any) -> tuple[Event, ...]:
        return tuple(self) * int(times)

    __rmul__ = __mul__

    def __repr__(self) -> str:
        return repr(tuple(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Events, (self.columns, self.first_stage))

    def __getnewargs__(self) -> tuple[Any, ...]:
        return (self.columns, self.first_stage)
