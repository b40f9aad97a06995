"""The text form of a timetable (what ``str(schedule)`` prints) read into each stage's actions.

``Schedule.parse`` builds the Schedule from what this reads. Text comes from users and files,
so it is read in time and memory linear in the text: digits are ASCII only, and an index that
the text's action count cannot reach is refused.
"""

from __future__ import annotations

from schedules.vocabulary import ACTION_TEXT as _ACTION_TEXT
from schedules.vocabulary import STAGE_LINE as _STAGE_LINE
from schedules.vocabulary import Action, Op, ScheduleError


def read_rows(text: str) -> tuple[list[tuple[str, list[Action]]], str, list[list[int]]]:
    """The actions of each stage line of ``text``; when some action names its chunk, the
    note for a chunk 0 found on two stages; and each line's overlapped pairs (the positions
    of the forwards written ``F3&B1``): the work of ``Schedule.parse`` short of building the
    Schedule.

    Raises:
        ScheduleError: see ``Schedule.parse``.
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
    written = [_stage_tokens(line, where, stage) for stage, (where, line) in enumerate(lines)]
    tokens, pairs = [], []
    for row in written:
        actions: list[str] = []
        paired: list[int] = []
        for token in row:
            first, joined, second = token.partition("&")
            if joined:
                paired.append(len(actions))
                actions.extend((first, second))
            else:
                actions.append(token)
        tokens.append(actions)
        pairs.append(paired)
    count = sum(len(row) for row in tokens)
    rows = [(where, _line_actions(row, f"{where} (stage {stage})", count))
            for stage, ((where, _), row) in enumerate(zip(lines, tokens))]
    named = next(((where, action) for (where, actions), row in zip(rows, tokens)
                  for action, token in zip(actions, row) if "@" in token), None)
    if named is None:  # no action names its chunk: stage s runs chunk s
        return [(where, [Action(action.op, action.microbatch, stage) for action in actions])
                for stage, (where, actions) in enumerate(rows)], "", pairs
    note = (f"An action without '@c' is chunk 0 when any action names its chunk ({named[0]} "
            f"names {named[1]}): name the chunk of every action on the other stages' lines, "
            f"or name no chunk on any line (stage s then runs chunk s)")
    return rows, note, pairs


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


def check_numbered(kind: str, plural: str, seen: dict[int, str], count: int) -> None:
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
