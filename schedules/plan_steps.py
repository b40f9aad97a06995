"""One stage's comm plan stored as arrays, read as its steps (``Action`` and ``Group``).

A comm plan at 64 stages holds 10^5 to 10^6 steps and lives as long as the Pipe; an object
per step and per op would cost every full garbage collection a scan of all of them (1.6 s
at P=64, M=1024 with ZB-V, timetable included). ``PlanSteps`` keeps a kind per step, the
actions as a ``StageOrder`` and the ops as arrays, and makes the objects when asked for.

A rank reads only its own stage's steps, so ``PlanSteps.later`` makes even the arrays on
first read: a plan of P stages then costs at build only what a stage that is read needs
(at P=64, M=1024 with ZB-V the arrays of all stages are a third of ``comm_plan``). The first
read makes them under a lock, once; every later read, from any thread, sees the same arrays.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from functools import cached_property
from itertools import accumulate, repeat
from operator import sub
from threading import Lock
from typing import Any, Callable, Generic, SupportsIndex, TypeVar, overload

from schedules.action import OP_CODES, OPS, Action, StageOrder, new_action
from schedules.comm_ops import CommOp, Group

ACTION_STEP, GROUP_STEP = 0, 1
KINDS = ("send", "recv")  # an op's kind code is its index here
SEND, RECEIVE = 0, 1


class OpArrays:
    """A growing list of ops, column by column: kind code, peer, channel, producer key parts."""

    __slots__ = ("kinds", "peers", "channels", "producer_ops", "microbatches", "chunks")

    def __init__(self) -> None:
        self.kinds, self.producer_ops = bytearray(), bytearray()
        self.peers, self.channels = array("q"), array("q")
        self.microbatches, self.chunks = array("q"), array("q")

    def add(self, kind: int, peer: int, channel: int, code: int, microbatch: int,
            chunk: int) -> None:
        self.kinds.append(kind)
        self.peers.append(peer)
        self.channels.append(channel)
        self.producer_ops.append(code)
        self.microbatches.append(microbatch)
        self.chunks.append(chunk)


Fields = tuple[bytes, StageOrder, "array[int]", OpArrays]  # PlanSteps' arguments, in order
_T = TypeVar("_T")


class _Field(Generic[_T]):
    """A field of ``PlanSteps``, read from the instance; on a ``PlanSteps.later`` not yet
    made, reading it makes every field (a non-data descriptor: once made, never called)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, steps: None, owner: type) -> _Field[_T]: ...

    @overload
    def __get__(self, steps: PlanSteps, owner: type) -> _T: ...

    def __get__(self, steps: PlanSteps | None, owner: type) -> _Field[_T] | _T:
        if steps is None:
            return self
        value: _T = steps._made()[self.name]
        return value


class PlanSteps(tuple[Any, ...]):
    """A stage's steps: reads as a tuple of ``Action`` and ``Group`` (its own storage empty).

    Attributes:
        kinds: per step, ``ACTION_STEP`` or ``GROUP_STEP``.
        actions: the action steps, in order.
        group_ends: per group, the index one past its last op in ``ops``.
        ops: every op of every group, in order.
        slots: per step, its index among the actions or among the groups (made when
            first read).
    """

    kinds: _Field[bytes] = _Field()
    actions: _Field[StageOrder] = _Field()
    group_ends: _Field[array[int]] = _Field()
    ops: _Field[OpArrays] = _Field()

    def __new__(cls, kinds: bytes, actions: StageOrder, group_ends: array[int],
                ops: OpArrays) -> PlanSteps:
        steps = super().__new__(cls)
        steps.__dict__.update(_checked(kinds, actions, group_ends, ops))
        return steps

    @classmethod
    def later(cls, make: Callable[[], Fields]) -> PlanSteps:
        """The PlanSteps of ``make()``'s fields, called on the first read of any of them (or
        of the steps), once, under a lock; ``make`` is dropped then."""
        steps = super().__new__(cls)
        steps.__dict__.update(_make=make, _lock=Lock())
        return steps

    @property
    def made(self) -> bool:
        """Whether the fields are made (always, but for a ``later`` one not yet read)."""
        return "_make" not in self.__dict__

    def _made(self) -> dict[str, Any]:
        """The instance's fields, made first if ``later`` left them to make."""
        fields = self.__dict__
        with fields["_lock"]:
            make = fields.get("_make")
            if make is not None:  # dropped only once made: a failed make raises again
                fields.update(_checked(*make()))
                del fields["_make"]
        return fields

    @cached_property
    def slots(self) -> array[int]:
        """Per step, its index among the actions or among the groups (made when first read,
        at C speed: an action's is its index less the groups before it)."""
        groups = list(accumulate(self.kinds))  # per step, the groups up to it, itself included
        as_action = map(sub, range(len(self.kinds)), groups)
        as_group = map(sub, groups, repeat(1))
        return array("q", map(tuple.__getitem__, zip(as_action, as_group), self.kinds))

    @classmethod
    def of(cls, steps: Sequence[Any]) -> PlanSteps | None:
        """The PlanSteps of ``steps`` (Actions and Groups), or None if a step or op is not
        one that arrays can hold (``validate_comm`` then names it)."""
        if isinstance(steps, PlanSteps):
            return steps
        kinds, actions, ends, ops = bytearray(), [], array("q"), OpArrays()
        for step in steps:
            if type(step) is Action:
                kinds.append(ACTION_STEP)
                actions.append(step)
                continue
            if type(step) is not Group:
                return None
            for op in step.ops:
                producer = getattr(op, "producer", None)
                if (type(op) is not CommOp or op.kind not in KINDS or type(op.peer) is not int
                        or type(op.channel) is not int or type(producer) is not Action):
                    return None
                ops.add(KINDS.index(op.kind), op.peer, op.channel, OP_CODES[producer.op],
                        producer.microbatch, producer.chunk)
            kinds.append(GROUP_STEP)
            ends.append(len(ops.kinds))
        return cls(bytes(kinds), StageOrder.of(actions), ends, ops)

    def __len__(self) -> int:
        return len(self.kinds)

    def __bool__(self) -> bool:
        return bool(self.kinds)

    @overload
    def __getitem__(self, index: SupportsIndex) -> Any: ...

    @overload
    def __getitem__(self, index: slice[Any, Any, Any]) -> tuple[Any, ...]: ...

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self[at] for at in range(*index.indices(len(self.kinds))))
        slot = self.slots[index]
        if self.kinds[index] == ACTION_STEP:
            return self.actions[slot]
        return self.group(slot)

    def group(self, number: int) -> Group:
        """Group ``number`` of this stage (counting groups only)."""
        start = self.group_ends[number - 1] if number else 0
        ops = self.ops
        return Group(tuple(
            CommOp(KINDS[ops.kinds[at]], ops.peers[at],  # type: ignore[arg-type]
                   new_action(OPS[ops.producer_ops[at]], ops.microbatches[at], ops.chunks[at]),
                   ops.channels[at])
            for at in range(start, self.group_ends[number])))

    def __iter__(self) -> Iterator[Any]:
        for at in range(len(self.kinds)):
            yield self[at]

    def texts(self) -> list[str]:
        """``str`` of every step."""
        return [str(step) for step in self]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash((self.kinds, hash(self.actions), self.group_ends.tobytes()))

    def __add__(self, other: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(self) + tuple(other)

    def __radd__(self, other: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(other) + tuple(self)

    def __contains__(self, step: object) -> bool:
        return any(item == step for item in self)

    def index(self, step: Any, start: Any = 0, stop: Any = None) -> int:
        for at in range(start, len(self) if stop is None else stop):
            if self[at] == step:
                return at
        raise ValueError(f"{step!r} is not in the stage's plan")

    def count(self, step: Any) -> int:
        return sum(1 for item in self if item == step)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"PlanSteps are read-only: cannot set {name}")

    def __repr__(self) -> str:
        return f"PlanSteps({' '.join(self.texts())})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (PlanSteps, (self.kinds, self.actions, self.group_ends, self.ops))


def _checked(kinds: bytes, actions: StageOrder, group_ends: array[int],
             ops: OpArrays) -> dict[str, Any]:
    """PlanSteps' fields by name, once the step kinds are checked against the actions and
    groups."""
    groups = kinds.count(GROUP_STEP)
    counts = [len(kinds) - groups, groups]
    if counts != [len(actions), len(group_ends)]:
        raise ValueError(f"PlanSteps: {counts[0]} action and {counts[1]} group steps, "
                         f"but {len(actions)} actions and {len(group_ends)} groups")
    return {"kinds": bytes(kinds), "actions": actions, "group_ends": group_ends, "ops": ops}
