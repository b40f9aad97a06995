"""The vocabulary of a pipeline timetable: operations, actions and schedules, and their text.

A schedule's order is stored compactly (``StageOrder``: three arrays per stage, op,
micro-batch and chunk), not as an object per action: at 64 stages a timetable has 10^5 to
10^6 actions, alive for the life of the process, and every full garbage collection would
scan them (188 ms at P=64, M=1024 with ZB-V). ``order[stage]`` still reads as a sequence of
``Action``; they are made when asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

from schedules.pairs import checked_pairs, joined_pairs
from schedules.parse import check_numbered, read_rows
from schedules.stage_order import StageOrder
from schedules.vocabulary import (ACTION_TEXT, CODE_B, CODE_F, CODE_I, CODE_W, OP_CODES, OPS,
                                  STAGE_LINE, Action, Op, ScheduleError, count, new_action)

__all__ = ["ACTION_TEXT", "CODE_B", "CODE_F", "CODE_I", "CODE_W", "OPS", "OP_CODES",
           "STAGE_LINE", "Action", "Op", "Schedule", "ScheduleError", "StageOrder",
           "format_order", "new_action", "parse_order", "schedule_of_rows"]


@dataclass(frozen=True)
class Schedule:
    """A complete pipeline timetable: for every stage, its actions in execution order.

    Attributes:
        stages: number of pipeline stages (devices or ranks).
        microbatches: number of micro-batches per step.
        order: ``order[stage]`` is the sequence of actions that stage runs, in order
            (a ``StageOrder``; any sequences of actions are converted).
        placement: ``placement[chunk]`` is the stage that holds model chunk ``chunk``;
            by default chunk ``s`` lives on stage ``s`` (one chunk per stage).
        name: the generator's name, for titles and error messages.
        forward_only: True for an inference timetable (``pipe(x)``): forwards only,
            which ``validate`` then accepts without backwards (and rejects with any).
        pairs: ``pairs[stage]`` holds the positions ``p`` in that stage's order where the
            forward at ``p`` and the backward (``B`` or ``I``) at ``p + 1`` run as one
            overlapped pair (DeepSeek's ``F&B``): both start once both inputs are in, and
            each one's expert all-to-alls run while the other computes (``schedules.pairs``).
            Written ``F3@c1&B0`` in the text form; empty (no pairs) by default.
    """

    stages: int
    microbatches: int
    order: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...] = ()
    name: str = "custom"
    forward_only: bool = False
    pairs: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", count("stages", self.stages))
        object.__setattr__(self, "microbatches", count("microbatches", self.microbatches))
        if not isinstance(self.forward_only, bool):
            raise TypeError(f"forward_only must be a bool, got {self.forward_only!r}")
        order = tuple(StageOrder.of(actions, stage) for stage, actions in enumerate(self.order))
        object.__setattr__(self, "order", order)
        if len(order) != self.stages:
            raise ValueError(
                f"order must have one action list per stage: expected {self.stages}, "
                f"got {len(order)}"
            )
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
        object.__setattr__(self, "pairs", checked_pairs(self.pairs, order))

    @property
    def orders(self) -> tuple[StageOrder, ...]:
        """``order`` as the ``StageOrder`` arrays it is, for the linear passes."""
        return cast(tuple[StageOrder, ...], self.order)

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
        pairs = set()
        for actions in self.orders:
            at = actions.ops.find(CODE_I)
            while at >= 0:
                pairs.add((actions.microbatches[at], actions.chunks[at]))
                at = actions.ops.find(CODE_I, at + 1)
        return frozenset(pairs)

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
    for stage, actions in enumerate(schedule.orders):
        texts = actions.texts()
        start = 0
        if around is None and schedule.pairs[stage]:
            texts = joined_pairs(texts, schedule.pairs[stage])
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
    rows, note, pairs = read_rows(text)
    return schedule_of_rows(rows, name, chunk_zero_note=note, pairs=pairs)


def schedule_of_rows(
    rows: Sequence[tuple[str, list[Action]]], name: str, chunk_zero_note: str = "",
    pairs: Sequence[Sequence[int]] = (),
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
        pairs: per stage, the positions of its overlapped forward-and-backward pairs.

    Raises:
        ScheduleError: a stage without actions, a chunk on two stages, a gap in the
            micro-batches or chunks, a pair that is not a forward then a backward.
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
    check_numbered("micro-batch", "micro-batches", microbatches, count)
    check_numbered("chunk", "chunks", {chunk: where for chunk, (_, where) in owner.items()},
                    count)
    order = tuple(tuple(actions) for _, actions in rows)
    return Schedule(
        stages=len(rows),
        microbatches=len(microbatches),
        order=order,
        placement=tuple(owner[chunk][0] for chunk in range(len(owner))),
        name=name,
        forward_only=all(action.op is Op.F for actions in order for action in actions),
        pairs=tuple(tuple(stage) for stage in pairs),
    )
