"""The vocabulary of a pipeline timetable: operations, actions and schedules, and their text."""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
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
_ACTION_TEXT = re.compile(r"^([FBIW])([0-9]+)(?:@c([0-9]+))?$")
_STAGE_LINE = re.compile(r"^stage\s+([0-9]+)\s*:(.*)$")


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
        match = _ACTION_TEXT.match(text.strip())
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


def _count(name: str, value: Any) -> int:
    """A schedule's stage or micro-batch count: an int >= 1, or a TypeError/ValueError."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(
            f"a schedule needs {name} as an int >= 1, got {value!r} ({type(value).__name__})"
        )
    number = operator.index(value)
    if number < 1:
        raise ValueError(f"a schedule needs {name} >= 1, got {name}={number}")
    return number


@dataclass(frozen=True)
class Schedule:
    """A complete pipeline timetable: for every stage, its actions in execution order.

    Attributes:
        stages: number of pipeline stages (devices or ranks).
        microbatches: number of micro-batches per step.
        order: ``order[stage]`` is the tuple of actions that stage runs, in order.
        placement: ``placement[chunk]`` is the stage that holds model chunk ``chunk``;
            by default chunk ``s`` lives on stage ``s`` (one chunk per stage).
        name: the generator's name, for titles and error messages.
        forward_only: True for an inference timetable (``pipe(x)``): forwards only,
            which ``validate`` then accepts without backwards (and rejects with any).
    """

    stages: int
    microbatches: int
    order: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...] = ()
    name: str = "custom"
    forward_only: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", _count("stages", self.stages))
        object.__setattr__(self, "microbatches", _count("microbatches", self.microbatches))
        if not isinstance(self.forward_only, bool):
            raise TypeError(f"forward_only must be a bool, got {self.forward_only!r}")
        order = tuple(tuple(actions) for actions in self.order)
        object.__setattr__(self, "order", order)
        if len(order) != self.stages:
            raise ValueError(
                f"order must have one action list per stage: expected {self.stages}, "
                f"got {len(order)}"
            )
        _check_actions_are_actions(order)
        placement = tuple(self.placement) or tuple(range(self.stages))
        object.__setattr__(self, "placement", placement)
        bad = [stage for stage in placement if not 0 <= stage < self.stages]
        if bad:
            raise ValueError(
                f"placement maps chunks to stages 0..{self.stages - 1}, got stage {bad[0]}"
            )
        missing = sorted(set(range(self.stages)) - set(placement))
        if missing:
            raise ValueError(f"placement leaves stage {missing[0]} without a model chunk")

    @cached_property
    def chunks(self) -> int:
        """Total number of model chunks (stages x chunks per stage)."""
        return len(self.placement)

    @cached_property
    def chunks_of_stage(self) -> tuple[tuple[int, ...], ...]:
        """``chunks_of_stage[stage]``: the model chunks that stage holds, in chunk order."""
        return tuple(
            tuple(chunk for chunk, owner in enumerate(self.placement) if owner == stage)
            for stage in range(self.stages)
        )

    @cached_property
    def split_backward(self) -> frozenset[tuple[int, int]]:
        """The (microbatch, chunk) pairs whose backward is split into I and W."""
        return frozenset(
            (action.microbatch, action.chunk)
            for actions in self.order
            for action in actions
            if action.op is Op.I
        )

    def backward_op(self, microbatch: int, chunk: int) -> Op:
        """The op that produces the input gradient of (microbatch, chunk): ``I`` or ``B``."""
        return Op.I if (microbatch, chunk) in self.split_backward else Op.B

    def __str__(self) -> str:
        return format_order(self)

    @classmethod
    def parse(cls, text: str, name: str = "custom") -> Schedule:
        """Read a timetable printed by ``str(schedule)``: ``Schedule.parse(str(s), s.name) == s``.

        See :func:`parse_order` for the form; the result is checked for form only:
        ``validate`` it before running it (``schedules.text`` reads CSV and files).

        Raises:
            ScheduleError: the text is not a timetable (the message names the line).
        """
        return parse_order(text, name)


def _check_actions_are_actions(order: tuple[tuple[Any, ...], ...]) -> None:
    for stage, actions in enumerate(order):
        for index, action in enumerate(actions):
            if not isinstance(action, Action):
                raise TypeError(
                    f"order[{stage}][{index}] must be an Action, got {action!r} "
                    f"({type(action).__name__}); build one with Action(Op.F, 3) or "
                    f"Action.parse('F3')"
                )


def format_order(
    schedule: Schedule, around: tuple[int, int] | None = None, width: int = 6, mark: bool = True
) -> str:
    """The timetable as text, one line per stage; ``around=(stage, index)`` shows a window.

    Args:
        schedule: the timetable to print.
        around: if given, only ``width`` actions either side of that position, marked ``[ ]``.
        width: how many neighbours to show either side of ``around``.
    """
    lines = []
    for stage, actions in enumerate(schedule.order):
        texts = [str(action) for action in actions]
        start = 0
        if around is not None:
            start = max(0, around[1] - width)
            if mark and stage == around[0] and around[1] < len(texts):
                texts[around[1]] = f"[{texts[around[1]]}]"
            texts = texts[start : around[1] + width + 1]
        prefix = "... " if start else ""
        lines.append(f"stage {stage}: {prefix}{' '.join(texts)}")
    return "\n".join(lines)


def parse_order(text: str, name: str = "custom") -> Schedule:
    """The Schedule that ``text`` prints as: the inverse of ``str(schedule)``.

    Blank lines and ``#`` comments are ignored. The counts are read off the actions:
    micro-batches ``0..M-1`` and chunks ``0..C-1`` must each appear; a chunk lives on the
    stage whose line runs it (that is the placement); a timetable of forwards alone is a
    forward-only one. When no action names its chunk (no ``@c``), stage ``s`` runs chunk
    ``s``: with one chunk per stage there is one reading. The form is checked, not whether
    it runs: ``validate`` does that.

    >>> from schedules import one_f_one_b
    >>> text = str(one_f_one_b(stages=2, microbatches=2))
    >>> print(text)
    stage 0: F0 F1 B0 B1
    stage 1: F0@c1 B0@c1 F1@c1 B1@c1
    >>> Schedule.parse(text, name="1f1b") == one_f_one_b(stages=2, microbatches=2)
    True
    >>> by_hand = "stage 0: F0 F1 B0 B1\\nstage 1: F0 B0 F1 B1"  # no chunk named
    >>> Schedule.parse(by_hand, name="1f1b") == one_f_one_b(stages=2, microbatches=2)
    True

    Args:
        text: one line ``stage s: <actions>`` per stage, stages in order from 0.
        name: the schedule's name, for titles and messages.

    Raises:
        ScheduleError: a line not of that form, naming the line, what was expected and
            what it holds; an index no action count of the text can reach; a gap in the
            micro-batches or chunks; a chunk on two stages.
    """
    if not isinstance(text, str):
        raise TypeError(f"a timetable is text, got {type(text).__name__}")
    lines = [(f"line {number}", line) for number, raw in enumerate(text.splitlines(), start=1)
             if (line := raw.split("#", 1)[0].strip())]
    if not lines:
        raise ScheduleError(
            "expected a timetable, one line per stage such as 'stage 0: F0 F1 B0 B1', "
            "got no stage lines"
        )
    tokens = [_stage_tokens(line, where, stage) for stage, (where, line) in enumerate(lines)]
    count = sum(len(row) for row in tokens)
    rows = [(where, _line_actions(row, f"{where} (stage {stage})", count))
            for stage, ((where, _), row) in enumerate(zip(lines, tokens))]
    named = next(((where, action) for (where, actions), row in zip(rows, tokens)
                  for action, token in zip(actions, row) if "@" in token), None)
    if named is None:  # no action names its chunk: stage s runs chunk s
        return schedule_of_rows([
            (where, [Action(action.op, action.microbatch, stage) for action in actions])
            for stage, (where, actions) in enumerate(rows)
        ], name)
    note = (f"An action without '@c' is chunk 0 when any action names its chunk ({named[0]} "
            f"names {named[1]}): name the chunk of every action on the other stages' lines, "
            f"or name no chunk on any line (stage s then runs chunk s)")
    return schedule_of_rows(rows, name, chunk_zero_note=note)


def _stage_tokens(line: str, where: str, stage: int) -> list[str]:
    """The action texts on the line of ``stage``, the line's form checked."""
    if "..." in line or "[" in line:
        raise ScheduleError(
            f"{where}: {line!r} is a window of a timetable (as an error message shows one, "
            f"with '...' and '[ ]'); give every action of the stage"
        )
    match = _STAGE_LINE.match(line)
    if match is None:
        raise ScheduleError(
            f"{where}: expected 'stage {stage}: <actions>', e.g. 'stage {stage}: F0 B0', "
            f"got {abbreviate(line)!r}"
        )
    given = match.group(1).lstrip("0") or "0"  # compared as text: no int of a long number
    if given != str(stage):
        raise ScheduleError(
            f"{where}: expected stage {stage} next (one line per stage, in order from "
            f"stage 0), got stage {abbreviate(given)}"
        )
    return match.group(2).split()


def _line_actions(tokens: list[str], where: str, count: int) -> list[Action]:
    """The actions a line's ``tokens`` write, indices within what ``count`` actions number."""
    actions, position = [], 0
    try:
        for position, token in enumerate(tokens, start=1):
            match = _ACTION_TEXT.match(token)
            if match is None:
                raise ScheduleError(f"expected an action like 'F3', 'B3', 'I3@c1' or 'W3@c1' "
                                    f"(ASCII digits), got {abbreviate(token)!r}")
            op, microbatch, chunk = match.groups()
            actions.append(Action(Op(op), read_index(microbatch, "micro-batch", count),
                                  read_index(chunk or "0", "chunk", count)))
    except ScheduleError as error:  # the position is named here, not built for every action
        raise ScheduleError(f"{where}, action {position}: {error}") from None
    return actions


def read_index(digits: str, kind: str, count: int) -> int:
    """The index ASCII ``digits`` write, if ``count`` actions (the text's) can number it.

    Micro-batches and chunks are numbered from 0 without gaps, each run by some action,
    so every index is below the action count. A long number is refused by its length,
    before ``int`` spends time quadratic in its digits on it.

    Raises:
        ScheduleError: an index ``count`` actions cannot reach.
    """
    if len(digits) <= 18 or len(digits.lstrip("0")) <= 18:  # int() in constant time
        index = int(digits)
        if index < count:
            return index
    raise ScheduleError(
        f"{kind} {abbreviate(digits.lstrip('0') or '0')} is past what the text's {count} "
        f"actions can number: expected a {kind} below {count} (they are numbered from 0 "
        f"without gaps, each run by an action)"
    )


def abbreviate(text: str) -> str:
    """``text`` for a message: its first 40 characters and its length when it is longer."""
    return text if len(text) <= 48 else f"{text[:40]}...({len(text)} characters)"


def schedule_of_rows(
    rows: Sequence[tuple[str, list[Action]]], name: str, chunk_zero_note: str = ""
) -> Schedule:
    """The Schedule of each stage's actions, its counts and placement read off the actions.

    Linear in the actions: a gap in the numbering is found without building the range
    it spans.

    Args:
        rows: ``rows[stage]`` is ``(where, actions)``, ``where`` naming the text
            (``"line 3"``) for messages.
        name: the schedule's name.
        chunk_zero_note: added to the message for chunk 0 on two stages (the text form
            says there why an action without ``@c`` is chunk 0).

    Raises:
        ScheduleError: a stage without actions, a chunk on two stages, a gap in the
            micro-batches or chunks.
    """
    owner: dict[int, tuple[int, str]] = {}  # chunk -> (stage, where)
    microbatches: dict[int, str] = {}  # micro-batch -> where it first appears
    for stage, (where, actions) in enumerate(rows):
        if not actions:
            raise ScheduleError(f"{where}: stage {stage} runs no action; every stage holds a "
                                f"model chunk and runs its forwards")
        for action in actions:
            microbatches.setdefault(action.microbatch, where)
            first = owner.setdefault(action.chunk, (stage, where))
            if first[0] != stage:
                note = f". {chunk_zero_note}" if chunk_zero_note and action.chunk == 0 else ""
                raise ScheduleError(
                    f"{where}: chunk {action.chunk} runs on stage {stage} ({action}) and on "
                    f"stage {first[0]} ({first[1]}); a model chunk lives on one stage{note}"
                )
    count = sum(len(actions) for _, actions in rows)
    _check_numbered("micro-batch", "micro-batches", microbatches, count)
    _check_numbered("chunk", "chunks", {chunk: where for chunk, (_, where) in owner.items()},
                    count)
    order = tuple(tuple(actions) for _, actions in rows)
    return Schedule(
        stages=len(rows),
        microbatches=len(microbatches),
        order=order,
        placement=tuple(owner[chunk][0] for chunk in range(len(owner))),
        name=name,
        forward_only=all(action.op is Op.F for actions in order for action in actions),
    )


def _check_numbered(kind: str, plural: str, seen: dict[int, str], count: int) -> None:
    """Refuse a gap among the indices ``seen`` (index -> where it appears), in O(len(seen)):
    with a gap, the largest is past ``len(seen) - 1``."""
    largest = max(seen)
    if largest >= len(seen):
        missing = next(index for index in range(len(seen)) if index not in seen)
        raise ScheduleError(
            f"{seen[largest]}: expected {plural} 0..{len(seen) - 1} ({len(seen)} distinct "
            f"ones appear in {count} actions), got {kind} {largest}: {kind} {missing} appears "
            f"nowhere; {plural} are numbered from 0 without gaps"
        )
