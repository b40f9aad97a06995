"""Timetables from outside: torchtitan's compute-only CSV, and files (the text form too).

``Schedule.parse`` reads the text form, what a Schedule prints (``schedules.action``);
this module adds the CSV form of torch.distributed.pipelining's ``_dump_csv``
(torchtitan's ``pipeline_parallel_schedule_csv``): row ``r`` is stage (rank) ``r``, a cell
``1F3`` is chunk 1's forward of micro-batch 3, an empty cell is idle. Counts and
placement are read off the actions as for the text form.

Text comes from users and files (``Pipe(schedule=...)`` takes either), so both forms are
read in time and memory linear in the text (``schedules.parse.read_index``): digits are
ASCII only, and an index that the text's action count cannot reach is refused.
"""

from __future__ import annotations

import csv
import io
import os
import re
from pathlib import Path

from schedules.action import Action, Op, Schedule, ScheduleError, schedule_of_rows
from schedules.parse import abbreviate, read_index

_CSV_CELL = re.compile(r"^([0-9]+)([FBIW])([0-9]+)$")
_CSV_OTHER = re.compile(r"^\(?\d*(UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)"
                        r"|OVERLAP_F_B$")


def parse_csv(text: str, name: str = "custom") -> Schedule:
    """The Schedule a compute-only CSV describes (torchtitan's, torch's ``_dump_csv``).

    >>> print(parse_csv("0F0,0F1,,0B0,0B1\\n,1F0,1B0,1F1,1B1\\n"))
    stage 0: F0 F1 B0 B1
    stage 1: F0@c1 B0@c1 F1@c1 B1@c1

    Raises:
        ScheduleError: a cell that is not ``<chunk><F|B|I|W><micro-batch>`` (sends,
            receives and FSDP actions are named as such: pipesched derives them), or
            the checks of ``Schedule.parse``.
    """
    if not isinstance(text, str):
        raise TypeError(f"a CSV timetable is text, got {type(text).__name__}")
    try:
        cells = [[(column, cell.strip()) for column, cell in enumerate(row, start=1)
                  if cell.strip()] for row in csv.reader(io.StringIO(text))]
    except csv.Error as error:  # e.g. a cell past csv's field size limit (128 KiB)
        raise ScheduleError(f"expected a compute-only CSV, one row of actions per stage: "
                            f"{error}") from None
    while cells and not cells[-1]:
        cells.pop()
    if not cells:
        raise ScheduleError("expected one CSV row of actions per stage, got no actions")
    count = sum(len(row) for row in cells)
    return schedule_of_rows([(f"row {number}", _row_actions(row, number, count))
                             for number, row in enumerate(cells, start=1)], name)


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
    parse = parse_csv if file.suffix.lower() == ".csv" else Schedule.parse
    try:
        return parse(text, file.stem if name is None else name)
    except ScheduleError as error:
        raise ScheduleError(f"{file}: {error}") from None


def _row_actions(cells: list[tuple[int, str]], row: int, count: int) -> list[Action]:
    """The actions a CSV row's ``(column, cell)`` pairs write."""
    actions, column = [], 0
    try:
        for column, cell in cells:
            match = _CSV_CELL.match(cell)
            if match is None:
                raise _not_compute(cell)
            chunk, op, microbatch = match.groups()
            actions.append(Action(Op(op), read_index(microbatch, "micro-batch", count),
                                  read_index(chunk, "chunk", count)))
    except ScheduleError as error:  # the cell is named here, not built for every action
        raise ScheduleError(f"row {row} (stage {row - 1}), cell {column}: {error}") from None
    return actions


def _not_compute(cell: str) -> ScheduleError:
    if _CSV_OTHER.search(cell):
        return ScheduleError(
            f"{abbreviate(cell)!r} is a communication, sharding or overlapped action; "
            f"pipesched derives sends, receives and gathers from the compute order: give a "
            f"compute-only CSV (cells such as '0F3', '1B3', '1I3', '1W3')"
        )
    return ScheduleError(
        f"expected a compute action '<chunk><F|B|I|W><micro-batch>' such as '0F3' (chunk "
        f"0's forward of micro-batch 3) or an empty cell, got {abbreviate(cell)!r}"
    )
