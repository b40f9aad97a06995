"""The words of a timetable: operations, actions, their codes, and the error for a bad one.

``schedules.action`` re-exports all of it beside ``Schedule``; the codes (``OPS``) are what a
``StageOrder`` stores per action instead of an object.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

class ScheduleError(ValueError):
    """A timetable that cannot run: an action missing, duplicated, misplaced or deadlocked."""


class Op(Enum):
    """What a stage does to one micro-batch of one model chunk."""

    F = "F"  # forward
    B = "B"  # full backward: input and weight gradients together
    I = "I"  # noqa: E741  input-gradient half of a split backward (on the critical path)
    W = "W"  # weight-gradient half of a split backward (deferrable)

    # Members are singletons, so identity hashing is exact, and C-fast on hot paths.
    __hash__ = object.__hash__


# ASCII digits only: \d would take full-width and other scripts' digits too.
ACTION_TEXT = re.compile(r"^([FBIW])([0-9]+)(?:@c([0-9]+))?$")
STAGE_LINE = re.compile(r"^stage\s+([0-9]+)\s*:(.*)$")


@dataclass(frozen=True)
class Action:
    """One operation on one micro-batch of one model chunk.

    Prints compactly, ``F3`` for chunk 0 and ``I3@c1`` otherwise, and
    :meth:`parse` reads that text back.
    """

    op: Op
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        # Hot path (generators build 10^5 actions): exact types pass with three checks.
        op, microbatch, chunk = self.op, self.microbatch, self.chunk
        if op.__class__ is not Op:
            raise TypeError(
                f"Action op must be an Op member (Op.F, Op.B, Op.I or Op.W), got {op!r} "
                f"({type(op).__name__}); for text use Action.parse('F3')"
            )
        if microbatch.__class__ is not int or microbatch < 0:
            object.__setattr__(self, "microbatch", _index("microbatch", microbatch))
        if chunk.__class__ is not int or chunk < 0:
            object.__setattr__(self, "chunk", _index("chunk", chunk))

    def __str__(self) -> str:
        suffix = f"@c{self.chunk}" if self.chunk else ""
        return f"{self.op.value}{self.microbatch}{suffix}"

    def __repr__(self) -> str:
        return str(self)

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read an action printed by ``str(action)``, e.g. ``"F3"`` or ``"W0@c2"``.

        Raises:
            ValueError: the text is not of that form.
        """
        match = ACTION_TEXT.match(text.strip())
        if match is None:
            raise ValueError(f"expected an action like 'F3' or 'I3@c1', got {text!r}")
        op, microbatch, chunk = match.groups()
        return cls(Op(op), int(microbatch), int(chunk or 0))


def _index(name: str, value: Any) -> int:
    """``value`` as an int >= 0 (numpy integers welcome), or a TypeError/ValueError saying so."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"Action {name} must be an int >= 0, got {value!r} ({type(value).__name__})")
    number = operator.index(value)
    if number < 0:
        raise ValueError(f"Action {name} must be an int >= 0, got {number}")
    return number


def count(name: str, value: Any) -> int:
    """A schedule's stage or micro-batch count: an int >= 1, or a TypeError/ValueError."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(
            f"a schedule needs {name} as an int >= 1, got {value!r} ({type(value).__name__})"
        )
    number = operator.index(value)
    if number < 1:
        raise ValueError(f"a schedule needs {name} >= 1, got {name}={number}")
    return number


OPS: tuple[Op, ...] = (Op.F, Op.B, Op.I, Op.W)  # an op's code is its index here
OP_CODES: dict[Op, int] = {op: code for code, op in enumerate(OPS)}
CODE_F, CODE_B, CODE_I, CODE_W = range(4)


def new_action(op: Op, microbatch: int, chunk: int) -> Action:
    """An Action from checked parts, without the frozen ``__init__``'s checks and setattrs."""
    action = object.__new__(Action)
    fields = action.__dict__
    fields["op"], fields["microbatch"], fields["chunk"] = op, microbatch, chunk
    return action


