"""A timetable as text: ``str(schedule)`` read back, torchtitan's compute-only CSV, and files.

The text form is what a Schedule prints, one line per stage in stage order::

    stage 0: F0 F1 B0 B1
    stage 1: F0@c1 B0@c1 F1@c1 B1@c1

Blank lines and ``#`` comments are ignored. The counts are read off the actions:
micro-batches ``0..M-1`` and chunks ``0..C-1`` must each appear; a chunk lives on
the stage whose line runs it (that is the placement); a timetable of forwards alone
is a forward-only one. The CSV form is torch.distributed.pipelining's ``_dump_csv``
(torchtitan's ``pipeline_parallel_schedule_csv``): row ``r`` is stage (rank) ``r``,
a cell ``1F3`` is chunk 1's forward of micro-batch 3, an empty cell is idle.

Parsing checks the form only; ``validate`` checks that the timetable can run.
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Sequence
from pathlib import Path

from schedules.action import Action, Op, Schedule, ScheduleError

_STAGE_LINE = re.compile(r"^stage\s+(\d+)\s*:(.*)$")
_CSV_CELL = re.compile(r"^(\d+)([FBIW])(\d+)$")
_CSV_OTHER = re.compile(r"^\(?\d*(UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)"
                        r"|OVERLAP_F_B$")

# (where, for messages: "line 3"; the stage's actions)
_Row = tuple[str, list[Action]]


def parse_schedule(text: str, name: str = "custom") -> Schedule:
    """The Schedule that ``text`` prints as: the inverse of ``str(schedule)``.

    >>> from schedules import one_f_one_b
    >>> text = str(one_f_one_b(stages=2, microbatches=2))
    >>> print(text)
    stage 0: F0 F1 B0 B1
    stage 1: F0@c1 B0@c1 F1@c1 B1@c1
    >>> parse_schedule(text, name="1f1b") == one_f_one_b(stages=2, microbatches=2)
    True

    Args:
        text: one line ``stage s: <actions>`` per stage, stages in order from 0.
        name: the schedule's name, for titles and messages.

    Raises:
        ScheduleError: a line not of that form, naming the line, what was expected and
            what it holds; a gap in the micro-batches or chunks; a chunk on two stages.
    """
    if not isinstance(text, str):
        raise TypeError(f"a timetable is text, got {type(text).__name__}")
    rows: list[_Row] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if line:
            rows.append((f"line {number}", _stage_actions(line, number, len(rows))))
    if not rows:
        raise ScheduleError(
            "expected a timetable, one line per stage such as 'stage 0: F0 F1 B0 B1', "
            "got no stage lines"
        )
    return _assemble(rows, name)


def parse_csv(text: str, name: str = "custom") -> Schedule:
    """The Schedule a compute-only CSV describes (torchtitan's, torch's ``_dump_csv``).

    >>> print(parse_csv("0F0,0F1,,0B0,0B1\\n,1F0,1B0,1F1,1B1\\n"))
    stage 0: F0 F1 B0 B1
    stage 1: F0@c1 B0@c1 F1@c1 B1@c1

    Raises:
        ScheduleError: a cell that is not ``<chunk><F|B|I|W><micro-batch>`` (sends,
            receives and FSDP actions are named as such: pipesched derives them), or
            the checks of :func:`parse_schedule`.
    """
    if not isinstance(text, str):
        raise TypeError(f"a CSV timetable is text, got {type(text).__name__}")
    rows: list[_Row] = []
    for number, cells in enumerate(csv.reader(io.StringIO(text)), start=1):
        rows.append((f"row {number}", [
            _csv_action(cell.strip(), number, column)
            for column, cell in enumerate(cells, start=1) if cell.strip()
        ]))
    while rows and not rows[-1][1]:
        rows.pop()
    if not rows:
        raise ScheduleError("expected one CSV row of actions per stage, got no actions")
    return _assemble(rows, name)


def to_csv(schedule: Schedule) -> str:
    """``schedule`` as a compute-only CSV, one row per stage (read back by :func:`parse_csv`).

    >>> from schedules import one_f_one_b
    >>> print(to_csv(one_f_one_b(stages=2, microbatches=1)), end="")
    0F0,0B0
    1F0,1B0
    """
    return "".join(
        ",".join(f"{action.chunk}{action.op.value}{action.microbatch}" for action in actions)
        + "\n"
        for actions in schedule.order
    )


def read_schedule(path: str | os.PathLike[str], name: str | None = None) -> Schedule:
    """The timetable in the file at ``path``: CSV for a ``.csv`` file, else the text form.

    Args:
        path: the file.
        name: the schedule's name; by default the file's name without its suffix.

    Raises:
        FileNotFoundError: no such file.
        ScheduleError: the file's text is not a timetable (the message names the file).
    """
    file = Path(path)
    text = file.read_text(encoding="utf-8")
    parse = parse_csv if file.suffix.lower() == ".csv" else parse_schedule
    try:
        return parse(text, file.stem if name is None else name)
    except ScheduleError as error:
        raise ScheduleError(f"{file}: {error}") from None


def _stage_actions(line: str, number: int, stage: int) -> list[Action]:
    if "..." in line or "[" in line:
        raise ScheduleError(
            f"line {number}: {line!r} is a window of a timetable (as an error message "
            f"shows one, with '...' and '[ ]'); give every action of the stage"
        )
    match = _STAGE_LINE.match(line)
    if match is None:
        raise ScheduleError(
            f"line {number}: expected 'stage {stage}: <actions>', e.g. 'stage {stage}: F0 B0', "
            f"got {line!r}"
        )
    if int(match.group(1)) != stage:
        raise ScheduleError(
            f"line {number}: expected stage {stage} next (one line per stage, in order from "
            f"stage 0), got stage {int(match.group(1))}"
        )
    actions = []
    for position, token in enumerate(match.group(2).split(), start=1):
        try:
            actions.append(Action.parse(token))
        except ValueError:
            raise ScheduleError(
                f"line {number} (stage {stage}), action {position}: expected an action like "
                f"'F3', 'B3', 'I3@c1' or 'W3@c1', got {token!r}"
            ) from None
    return actions


def _csv_action(cell: str, row: int, column: int) -> Action:
    match = _CSV_CELL.match(cell)
    if match is not None:
        chunk, op, microbatch = match.groups()
        return Action(Op(op), int(microbatch), int(chunk))
    where = f"row {row} (stage {row - 1}), cell {column}"
    if _CSV_OTHER.search(cell):
        raise ScheduleError(
            f"{where}: {cell!r} is a communication, sharding or overlapped action; pipesched "
            f"derives sends, receives and gathers from the compute order: give a compute-only "
            f"CSV (cells such as '0F3', '1B3', '1I3', '1W3')"
        )
    raise ScheduleError(
        f"{where}: expected a compute action '<chunk><F|B|I|W><micro-batch>' such as '0F3' "
        f"(chunk 0's forward of micro-batch 3) or an empty cell, got {cell!r}"
    )


def _assemble(rows: Sequence[_Row], name: str) -> Schedule:
    """The Schedule of per-stage actions, counts and placement read off the actions."""
    owner: dict[int, tuple[int, str]] = {}  # chunk -> (stage, where)
    microbatches: set[int] = set()
    for stage, (where, actions) in enumerate(rows):
        if not actions:
            raise ScheduleError(f"{where}: stage {stage} runs no action; every stage holds a "
                                f"model chunk and runs its forwards")
        for action in actions:
            microbatches.add(action.microbatch)
            first = owner.setdefault(action.chunk, (stage, where))
            if first[0] != stage:
                raise ScheduleError(
                    f"{where}: chunk {action.chunk} runs on stage {stage} ({action}) and on "
                    f"stage {first[0]} ({first[1]}); a model chunk lives on one stage"
                )
    for kind, plural, seen in (("micro-batch", "micro-batches", microbatches),
                               ("chunk", "chunks", set(owner))):
        missing = sorted(set(range(max(seen) + 1)) - seen)
        if missing:
            raise ScheduleError(
                f"{kind} {missing[0]} appears nowhere, but {kind} {max(seen)} does: "
                f"{plural} are numbered from 0 without gaps"
            )
    order = tuple(tuple(actions) for _, actions in rows)
    return Schedule(
        stages=len(rows),
        microbatches=max(microbatches) + 1,
        order=order,
        placement=tuple(owner[chunk][0] for chunk in range(len(owner))),
        name=name,
        forward_only=all(action.op is Op.F for actions in order for action in actions),
    )
