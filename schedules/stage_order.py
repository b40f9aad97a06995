"""One stage's order stored as arrays (op codes, micro-batches, chunks), read as Actions.

At 64 stages a timetable has 10^5 to 10^6 actions, alive for the life of the process: an
object per action costs every full garbage collection a scan of all of them (188 ms at P=64,
M=1024 with ZB-V). A ``StageOrder`` is three arrays, which the collector does not track;
the linear passes (validate, simulate, the comm plan) read the arrays, and anything else
reads Actions, made when asked for.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from typing import Any, SupportsIndex, overload

from schedules.vocabulary import OP_CODES, OPS, Action, Op, ScheduleError, new_action

class StageOrder(tuple[Action, ...]):
    """One stage's actions, in order, as three arrays: op codes, micro-batches, chunks.

    A tuple of ``Action`` to its readers (indexing, slicing, iteration, ``in``, ``index``,
    ``+``, equality with a tuple of actions), making each Action when asked; its own tuple
    storage is empty. ``ops`` (a code per action, see ``OPS``), ``microbatches`` and
    ``chunks`` are the arrays, for the linear passes (validate, simulate, the comm plan).
    Hashes by its arrays: equal StageOrders hash equal (a tuple of the same actions need not).
    """

    ops: bytes
    microbatches: array[int]
    chunks: array[int]

    def __new__(cls, ops: bytes, microbatches: array[int], chunks: array[int]) -> StageOrder:
        if not len(ops) == len(microbatches) == len(chunks):
            raise ValueError(f"StageOrder: expected arrays of one length, got {len(ops)}, "
                             f"{len(microbatches)} and {len(chunks)}")
        order = super().__new__(cls)
        fields = order.__dict__
        fields["ops"], fields["microbatches"], fields["chunks"] = (
            bytes(ops), array("q", microbatches), array("q", chunks))
        return order

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a StageOrder is read-only: cannot set {name}")

    @classmethod
    def of(cls, actions: Iterable[Any], stage: int = 0) -> StageOrder:
        """The StageOrder of ``actions`` (each an ``Action``).

        Raises:
            TypeError: an item that is not an Action, naming ``order[stage][index]``.
            ScheduleError: a micro-batch or chunk past 2**63 - 1.
        """
        if isinstance(actions, StageOrder):
            return actions
        items = actions if isinstance(actions, (tuple, list)) else tuple(actions)
        ops, microbatches, chunks = bytearray(), array("q"), array("q")
        codes, action_type = OP_CODES, Action
        try:
            for action in items:
                if action.__class__ is not action_type and not isinstance(action, action_type):
                    _check_actions_are_actions(stage, tuple(items))
                ops.append(codes[action.op])
                microbatches.append(action.microbatch)
                chunks.append(action.chunk)
        except OverflowError:
            raise ScheduleError(f"stage {stage}: a micro-batch or chunk past 2**63 - 1 cannot "
                                f"run; expected indices below the counts") from None
        return cls(bytes(ops), microbatches, chunks)

    def __len__(self) -> int:
        return len(self.ops)

    def __bool__(self) -> bool:
        return bool(self.ops)

    @overload
    def __getitem__(self, index: SupportsIndex) -> Action: ...

    @overload
    def __getitem__(self, index: slice[Any, Any, Any]) -> tuple[Action, ...]: ...

    def __getitem__(self, index: Any) -> Action | tuple[Action, ...]:
        if isinstance(index, slice):
            return tuple(self._actions(*index.indices(len(self.ops))))
        return new_action(OPS[self.ops[index]], self.microbatches[index], self.chunks[index])

    def _actions(self, start: int, stop: int, step: int = 1) -> Iterator[Action]:
        ops, microbatches, chunks, new = self.ops, self.microbatches, self.chunks, new_action
        for at in range(start, stop, step):
            yield new(OPS[ops[at]], microbatches[at], chunks[at])

    def __iter__(self) -> Iterator[Action]:
        return self._actions(0, len(self.ops))

    def find(self, op: Op, microbatch: int, chunk: int, start: int = 0) -> int:
        """The position of ``(op, microbatch, chunk)`` at or after ``start``, or -1."""
        code, ops, microbatches, chunks = OP_CODES[op], self.ops, self.microbatches, self.chunks
        at = ops.find(code, start)
        while at >= 0:
            if microbatches[at] == microbatch and chunks[at] == chunk:
                return at
            at = ops.find(code, at + 1)
        return -1

    def __contains__(self, action: object) -> bool:
        return isinstance(action, Action) and self.find(*_parts(action)) >= 0

    def index(self, action: Any, start: Any = 0, stop: Any = None) -> int:
        at = self.find(*_parts(action), start) if isinstance(action, Action) else -1
        if at < 0 or (stop is not None and at >= stop):
            raise ValueError(f"{action!r} is not in the stage's order")
        return at

    def count(self, action: Any) -> int:
        return sum(1 for item in self if item == action) if isinstance(action, Action) else 0

    def texts(self) -> list[str]:
        """``str`` of every action, without making the actions."""
        letters = [op.value for op in OPS]
        return [f"{letters[op]}{microbatch}@c{chunk}" if chunk else f"{letters[op]}{microbatch}"
                for op, microbatch, chunk in zip(self.ops, self.microbatches, self.chunks)]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StageOrder):
            return (self.ops == other.ops and self.microbatches == other.microbatches
                    and self.chunks == other.chunks)
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash((self.ops, self.microbatches.tobytes(), self.chunks.tobytes()))

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

    def __mul__(self, times: Any) -> tuple[Action, ...]:
        return tuple(self) * int(times)

    __rmul__ = __mul__

    def __reversed__(self) -> Iterator[Action]:
        return self._actions(len(self.ops) - 1, -1, -1)

    def __repr__(self) -> str:
        return f"StageOrder({' '.join(self.texts())})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (StageOrder, (self.ops, self.microbatches, self.chunks))

    def __getnewargs__(self) -> tuple[Any, ...]:
        return (self.ops, self.microbatches, self.chunks)


def _parts(action: Action) -> tuple[Op, int, int]:
    return action.op, action.microbatch, action.chunk


def _check_actions_are_actions(stage: int, actions: tuple[Any, ...]) -> None:
    for index, action in enumerate(actions):
        if not isinstance(action, Action):
            raise TypeError(
                f"order[{stage}][{index}] must be an Action, got {action!r} "
                f"({type(action).__name__}); build one with Action(Op.F, 3) or "
                f"Action.parse('F3')"
            )
