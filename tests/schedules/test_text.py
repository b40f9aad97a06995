"""schedules.text: Schedule.parse is the inverse of str(schedule), CSV too, with errors by line."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import (Action, Op, Schedule, ScheduleError, forward_only, get_schedule,
                       parse_csv, read_schedule, schedule_info, schedule_names, to_csv,
                       validate)


def _sizes(name):
    low = schedule_info(name).min_microbatches
    for stages in (1, 2, 3, 4):
        first = low(stages) if low else 1
        for microbatches in sorted({first, first + 1, 2 * stages + 1, 3 * stages}):
            if microbatches >= first:
                yield name, stages, microbatches


GRID = [case for name in schedule_names() for case in _sizes(name)]


@pytest.mark.parametrize(("name", "stages", "microbatches"), GRID)
def test_every_registered_schedule_round_trips_as_text_and_csv(name, stages, microbatches):
    schedule = get_schedule(name, stages, microbatches)
    assert Schedule.parse(str(schedule), name=schedule.name) == schedule
    assert parse_csv(to_csv(schedule), name=schedule.name) == schedule
    inference = forward_only(schedule)
    assert Schedule.parse(str(inference), name=inference.name) == inference


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["interleaved-1f1b", "zb"]), st.integers(1, 5), st.integers(1, 12),
       st.integers(1, 3))
def test_options_that_change_the_shape_round_trip(name, stages, microbatches, extra):
    option = ({"chunks_per_stage": extra} if name == "interleaved-1f1b"
              else {"max_inflight": stages + extra})
    schedule = get_schedule(name, stages, microbatches, **option)
    parsed = Schedule.parse(str(schedule), name=schedule.name)
    assert parsed == schedule
    assert parsed.chunks == schedule.chunks and parsed.placement == schedule.placement


def test_a_hand_written_v_timetable_reads_its_counts_and_placement():
    text = """
    # two stages, chunks in a V: chunk 0 and 3 on stage 0, chunks 1 and 2 on stage 1
    stage 0: F0 F1 F0@c3 B0@c3 F1@c3 B1@c3 B0 B1

    stage 1: F0@c1 F1@c1 F0@c2 B0@c2 B0@c1 F1@c2 B1@c2 B1@c1   # trailing comment
    """
    schedule = Schedule.parse(text)
    assert (schedule.stages, schedule.microbatches, schedule.chunks) == (2, 2, 4)
    assert schedule.placement == (0, 1, 1, 0)
    assert schedule.name == "custom" and not schedule.forward_only
    assert schedule.order[1][3] == Action(Op.B, 0, 2)
    validate(schedule)


def test_forwards_alone_are_a_forward_only_timetable():
    schedule = Schedule.parse("stage 0: F0 F1\nstage 1: F0@c1 F1@c1")
    assert schedule.forward_only
    validate(schedule)


def test_parse_checks_the_form_and_validate_the_deadlock():
    # Stage 0 waits for B0 before its F1; stage 1 runs F1@c1, which needs that F1, before
    # the B0@c1 stage 0 waits for: a cycle, which parses but does not validate.
    deadlock = Schedule.parse("stage 0: F0 B0 F1 B1\nstage 1: F0@c1 F1@c1 B0@c1 B1@c1")
    with pytest.raises(ScheduleError, match="deadlock") as error:
        validate(deadlock)
    assert "F1@c1" in str(error.value)
    validate(Schedule.parse("stage 0: F0 F1 B0 B1\nstage 1: F0@c1 B0@c1 F1@c1 B1@c1"))


@pytest.mark.parametrize(("text", "message"), [
    ("", "expected a timetable, one line per stage such as 'stage 0: F0 F1 B0 B1', got no "
         "stage lines"),
    ("# only a comment\n\n", "got no stage lines"),
    ("stage 0: F0 B0\nstag 1: F0@c1 B0@c1",
     "line 2: expected 'stage 1: <actions>', e.g. 'stage 1: F0 B0', got 'stag 1: F0@c1 B0@c1'"),
    ("F0 B0", "line 1: expected 'stage 0: <actions>'"),
    ("stage 1: F0 B0", "line 1: expected stage 0 next (one line per stage, in order from "
                       "stage 0), got stage 1"),
    ("stage 0: F0 B0\n\nstage 0: F0@c1 B0@c1", "line 3: expected stage 1 next"),
    ("stage 0: F0 X1 B0", "line 1 (stage 0), action 2: expected an action like 'F3', 'B3', "
                          "'I3@c1' or 'W3@c1' (ASCII digits), got 'X1'"),
    ("stage 0: F0 B0\nstage 1: F0@c1 B0c1", "line 2 (stage 1), action 2"),
    ("stage 0: ... F3 [B2] B3", "line 1: 'stage 0: ... F3 [B2] B3' is a window of a timetable"),
    ("stage 0: F0 B0@c1\nstage 1: F0@c1 B0@c0",
     "line 2: chunk 1 runs on stage 1 (F0@c1) and on stage 0 (line 1); a model chunk lives on "
     "one stage"),
    ("stage 0: F0 F2 B0 B2", "line 1: expected micro-batches 0..1 (2 distinct ones appear in 4 "
                             "actions), got micro-batch 2: micro-batch 1 appears nowhere; "
                             "micro-batches are numbered from 0 without gaps"),
    ("stage 0: F0 B0\nstage 1: F0@c2 B0@c2", "line 2: expected chunks 0..1 (2 distinct ones "
                                              "appear in 4 actions), got chunk 2: chunk 1 "
                                              "appears nowhere"),
    ("stage 0: F0 B0\nstage 1:", "line 2: stage 1 runs no action"),
])
def test_malformed_text_names_the_line_and_what_was_expected(text, message):
    with pytest.raises(ScheduleError, match=re.escape(message)):
        Schedule.parse(text)


def test_text_must_be_a_string():
    with pytest.raises(TypeError, match="a timetable is text, got bytes"):
        Schedule.parse(b"stage 0: F0 B0")


def test_torchtitan_csv_with_idle_cells_reads_chunk_op_microbatch():
    # torch's _dump_csv: a row per rank, '<stage index><op><micro-batch>', '' when idle.
    text = "0F0,0F1,,0I0,0W0,0I1,0W1\n,1F0,1I0,1F1,1I1,1W0,1W1\n"
    schedule = parse_csv(text, name="mine")
    assert schedule.order == (
        tuple(Action.parse(t) for t in "F0 F1 I0 W0 I1 W1".split()),
        tuple(Action.parse(t) for t in "F0@c1 I0@c1 F1@c1 I1@c1 W0@c1 W1@c1".split()),
    )
    assert (schedule.stages, schedule.microbatches, schedule.name) == (2, 2, "mine")
    validate(schedule)


@pytest.mark.parametrize(("text", "message"), [
    ("0F0,0B0\n1F0,0SEND_F0,1B0", "row 2 (stage 1), cell 2: '0SEND_F0' is a communication, "
                                  "sharding or overlapped action; pipesched derives sends"),
    ("0UNSHARD,0F0,0B0", "row 1 (stage 0), cell 1: '0UNSHARD' is a communication"),
    ("(0F1;1B0)OVERLAP_F_B", "'(0F1;1B0)OVERLAP_F_B' is a communication, sharding or overlapped"),
    ("0F0,F1", "row 1 (stage 0), cell 2: expected a compute action '<chunk><F|B|I|W>"
               "<micro-batch>' such as '0F3' (chunk 0's forward of micro-batch 3) or an empty "
               "cell, got 'F1'"),
    ("", "expected one CSV row of actions per stage, got no actions"),
    ("0F0,0B0\n,,\n2F0,2B0", "row 2: stage 1 runs no action"),
])
def test_malformed_csv_names_the_row_and_cell(text, message):
    with pytest.raises(ScheduleError, match=re.escape(message)):
        parse_csv(text)


def test_a_file_is_read_as_text_or_csv_by_its_suffix_and_named_after_it(tmp_path):
    schedule = get_schedule("zb-v", 2, 4)
    (tmp_path / "mine.txt").write_text(str(schedule))
    (tmp_path / "titan.csv").write_text(to_csv(schedule))
    assert read_schedule(tmp_path / "mine.txt").order == schedule.order
    assert read_schedule(str(tmp_path / "titan.csv")).placement == schedule.placement
    assert read_schedule(tmp_path / "titan.csv").name == "titan"
    assert read_schedule(tmp_path / "mine.txt", name="zb-v") == schedule


def test_a_bad_file_is_named_in_the_error(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("stage 0: F0 B0\nstage 2: F0@c1 B0@c1\n")
    with pytest.raises(ScheduleError, match=re.escape(f"{path}: line 2: expected stage 1 next")):
        read_schedule(path)
    with pytest.raises(FileNotFoundError):
        read_schedule(tmp_path / "missing.txt")


# Bounded input (issue 39, item 5): text is read in O(actions) time and memory, ASCII digits.

SIXTY_BYTES = "stage 0: F0 B0 F99999999999999999999 B99999999999999999999"

# A fresh interpreter under a 1 GiB address-space limit, set before schedules is imported:
# the parse of the 60-byte timetable must be a ScheduleError, within a second.
_LIMITED_PARSE = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from schedules import Schedule, ScheduleError
start = time.perf_counter()
try:
    Schedule.parse(sys.argv[1])
except ScheduleError as error:
    print(f"ScheduleError {time.perf_counter() - start:.6f}")
    print(error)
except MemoryError:
    print("MemoryError")
"""


def test_the_60_byte_timetable_is_a_schedule_error_within_a_second_under_1_gib():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _LIMITED_PARSE, SIXTY_BYTES],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    verdict, seconds, *_ = done.stdout.split()
    assert verdict == "ScheduleError", done.stdout
    assert float(seconds) < 1.0
    assert ("line 1 (stage 0), action 3: micro-batch 99999999999999999999 is past what the "
            "text's 4 actions can number: expected a micro-batch below 4") in done.stdout


@pytest.mark.parametrize(("text", "message"), [
    # (the 60-byte case itself runs in a child under a memory limit, above: on today's main
    # it would take 24 GiB of this process)
    ("stage 0: F0 B0 F1000000 B1000000\nstage 1: F0@c1 B0@c1",
     "line 1 (stage 0), action 3: micro-batch 1000000 is past what the text's 6 actions can "
     "number: expected a micro-batch below 6 (they are numbered from 0 without gaps, each run "
     "by an action)"),
    ("stage 0: F0 B0\nstage 1: F0@c1000000 B0@c1000000",
     "line 2 (stage 1), action 1: chunk 1000000 is past what the text's 4 actions can number: "
     "expected a chunk below 4"),
    ("stage 0: F" + "9" * 5000, "line 1 (stage 0), action 1: micro-batch 999"),
    ("stage 0: F0@c" + "7" * 5000, "line 1 (stage 0), action 1: chunk 777"),
    ("stage " + "9" * 5000 + ": F0 B0", "line 1: expected stage 0 next (one line per stage, "
                                         "in order from stage 0), got stage 999"),
])
def test_indices_past_what_the_actions_can_number_are_refused_without_building_them(
        text, message):
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ScheduleError, match=re.escape(message)):
            Schedule.parse(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # today's set(range(max + 1)) takes tens of MiB for 10**6


@pytest.mark.parametrize(("parse", "text", "message"), [
    (parse_csv, "0F0,0B0,0F1000000,0B1000000", "row 1 (stage 0), cell 3: micro-batch 1000000 "
                                              "is past what the text's 4 actions can number"),
    (parse_csv, "0F0,0B0\n1000000F0,1000000B0", "row 2 (stage 1), cell 1: chunk 1000000 is past "
                                               "what the text's 4 actions can number: expected "
                                               "a chunk below 4"),
    (parse_csv, "0F" + "9" * 5000, "row 1 (stage 0), cell 1: micro-batch 999"),
    (parse_csv, "9" * 5000 + "F0", "row 1 (stage 0), cell 1: chunk 999"),
    (parse_csv, "0F" + "9" * 200_000, "expected a compute-only CSV, one row of actions per "
                                      "stage: field larger than field limit"),
])
def test_csv_indices_are_bounded_too(parse, text, message):
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ScheduleError, match=re.escape(message)):
            parse(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20) + 16 * len(text)  # linear in the text, not in the index


def test_a_file_holding_the_60_byte_timetable_is_refused(tmp_path):
    # Pipe(schedule=<path>) reads files with read_schedule; Pipe(schedule=<text>) parses
    # with Schedule.parse or parse_csv.
    path = tmp_path / "huge.txt"
    path.write_text(SIXTY_BYTES.replace("99999999999999999999", "1000000"))
    with pytest.raises(ScheduleError, match=re.escape(
            f"{path}: line 1 (stage 0), action 3: micro-batch 1000000 is past")):
        read_schedule(path)


@pytest.mark.parametrize(("text", "message"), [
    ("stage 0: F\uff10 B\uff10", "action 1: expected an action like 'F3', 'B3', 'I3@c1' or "
                                 "'W3@c1' (ASCII digits), got 'F\uff10'"),
    ("stage 0: F0 B0\nstage 1: F0@c\uff11 B0@c1", "line 2 (stage 1), action 1"),
    ("stage \uff10: F0 B0", "line 1: expected 'stage 0: <actions>'"),
    ("stage 0: F\u0660 B\u0660", "line 1 (stage 0), action 1"),  # Arabic-Indic zero
])
def test_only_ascii_digits_are_digits(text, message):
    with pytest.raises(ScheduleError, match=re.escape(message)):
        Schedule.parse(text)


@pytest.mark.parametrize("text", ["\uff10F0,0B0", "0F\uff10,0B0", "0F0,0B\u0660"])
def test_only_ascii_digits_are_digits_in_csv(text):
    with pytest.raises(ScheduleError, match="expected a compute action"):
        parse_csv(text)


@pytest.mark.parametrize("text", ["F\uff13", "F3@c\uff11", "B\u0663"])
def test_an_action_has_ascii_digits(text):
    with pytest.raises(ValueError, match="expected an action like 'F3' or 'I3@c1'"):
        Action.parse(text)


# A timetable whose lines name no chunk (issue 39, item 7): stage s runs chunk s.

def _without_chunks(schedule):
    return "\n".join(
        f"stage {stage}: " + " ".join(f"{a.op.value}{a.microbatch}" for a in actions)
        for stage, actions in enumerate(schedule.order))


@pytest.mark.parametrize(("name", "stages", "microbatches"),
                         [("1f1b", 2, 4), ("1f1b", 4, 8), ("gpipe", 3, 5), ("zb-h1", 4, 6)])
def test_lines_that_name_no_chunk_run_chunk_s_on_stage_s(name, stages, microbatches):
    expected = get_schedule(name, stages, microbatches)
    text = _without_chunks(expected)
    assert "@c" not in text
    assert Schedule.parse(text, name=expected.name) == expected
    validate(Schedule.parse(text))


def test_a_hand_written_1f1b_without_chunks_is_one_f_one_b(tmp_path):
    text = """
    stage 0: F0 F1 B0 F2 B1 F3 B2 B3
    stage 1: F0 B0 F1 B1 F2 B2 F3 B3
    """
    assert Schedule.parse(text, name="1f1b") == get_schedule("1f1b", 2, 4)
    (tmp_path / "1f1b.txt").write_text(text)
    assert read_schedule(tmp_path / "1f1b.txt") == get_schedule("1f1b", 2, 4)


def test_a_text_naming_chunks_on_some_lines_only_is_refused_with_the_two_readings():
    with pytest.raises(ScheduleError, match=re.escape(
            "line 2: chunk 0 runs on stage 1 (F0) and on stage 0 (line 1); a model chunk "
            "lives on one stage. An action without '@c' is chunk 0 when any action names its "
            "chunk (line 2 names B0@c1): name the chunk of every action on the other stages' "
            "lines, or name no chunk on any line (stage s then runs chunk s)")):
        Schedule.parse("stage 0: F0 B0\nstage 1: F0 B0@c1")
