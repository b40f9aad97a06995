"""Pipe(schedule=text or path): a hand-written timetable runs exact, or is refused before a step."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline import Pipe
from schedules import Schedule, ScheduleError, get_schedule, schedule_names, to_csv

TOLERANCE = 1e-10
ROWS = 7  # uneven over 3 micro-batches

# One chunk per stage; micro-batch 1 splits its backward into I and W, the others do not.
LOOP = """
# 2 stages, 3 micro-batches, written by hand
stage 0: F0 F1 B0 F2 I1 B2 W1
stage 1: F0@c1 B0@c1 F1@c1 I1@c1 F2@c1 W1@c1 B2@c1
"""
# Two chunks per stage in a V: chunks 0 and 3 on stage 0, chunks 1 and 2 on stage 1.
V_SHAPE = """
stage 0: F0 F1 F0@c3 B0@c3 F1@c3 B1@c3 B0 B1
stage 1: F0@c1 F1@c1 F0@c2 B0@c2 B0@c1 F1@c2 B1@c2 B1@c1
"""
# Stage 0 waits for B0 before F1; stage 1 runs F1@c1, which needs that F1, first.
DEADLOCK = "stage 0: F0 B0 F1 B1\nstage 1: F0@c1 F1@c1 B0@c1 B1@c1"


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
        nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3), nn.Tanh(),
    ).double()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, 5, generator=generator, dtype=torch.float64)
    return x, torch.randn(ROWS, 3, generator=generator, dtype=torch.float64)


def gradients(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            for p in module.parameters()]


def check_exact(schedule: object, microbatches: int) -> Pipe:
    plain, x, target = model(), *data()
    piped = copy.deepcopy(plain)
    expected_loss = nn.MSELoss()(plain(x), target)
    expected_loss.backward()
    pipe = Pipe(piped, microbatches, schedule=schedule, loss_fn=nn.MSELoss())
    loss = pipe.step(x, target)
    assert abs(float(loss) - float(expected_loss.detach())) < TOLERANCE
    for mine, theirs in zip(gradients(piped), gradients(plain)):
        assert float((mine - theirs).abs().max()) < TOLERANCE
    return pipe


@pytest.mark.parametrize(("text", "written"), [
    (LOOP, LOOP), (V_SHAPE, V_SHAPE), (to_csv(Schedule.parse(V_SHAPE)), V_SHAPE),
], ids=["loop", "v", "v-as-csv"])
def test_a_hand_written_timetable_runs_with_the_plain_models_gradients(text: str,
                                                                       written: str) -> None:
    expected = Schedule.parse(written)
    pipe = check_exact(text, expected.microbatches)
    assert pipe.schedule.order == expected.order
    assert pipe.schedule.placement == expected.placement
    assert pipe.stages == 2 and len(pipe.balance) == expected.chunks


@pytest.mark.parametrize("form", ["txt", "csv", "path"])
def test_a_timetable_file_runs_named_after_the_file(tmp_path: Path, form: str) -> None:
    parsed = Schedule.parse(V_SHAPE)
    file = tmp_path / f"hand.{'csv' if form == 'csv' else 'txt'}"
    file.write_text(to_csv(parsed) if form == "csv" else V_SHAPE)
    pipe = check_exact(file if form == "path" else str(file), parsed.microbatches)
    assert pipe.schedule.order == parsed.order
    assert pipe.schedule.name == "hand"


def test_a_deadlocking_timetable_is_refused_before_any_step() -> None:
    module = model()
    with pytest.raises(ScheduleError, match="deadlock") as error:
        Pipe(module, 2, schedule=DEADLOCK, loss_fn=nn.MSELoss())
    assert "F1@c1" in str(error.value)
    assert all(p.grad is None for p in module.parameters())


def test_micro_batches_that_do_not_match_chunks_are_named() -> None:
    message = ("the timetable has stages=2, microbatches=3, but this Pipe has stages=2, "
               "chunks=4; write one with those counts, or pass chunks=3")
    with pytest.raises(ValueError, match=re.escape(message)):
        Pipe(model(), 4, schedule=LOOP, loss_fn=nn.MSELoss())


def test_stages_that_do_not_match_the_devices_are_named() -> None:
    with pytest.raises(ValueError, match=re.escape(
            "the stage count must agree everywhere, got the timetable's stages=2, "
            "len(devices)=3")):
        Pipe(model(), 3, devices=["cpu"] * 3, schedule=LOOP, loss_fn=nn.MSELoss())


def test_bad_text_names_the_line() -> None:
    with pytest.raises(ScheduleError, match=re.escape(
            "line 2 (stage 1), action 3: expected an action like 'F3'")):
        Pipe(model(), 2, schedule="stage 0: F0 B0\nstage 1: F0@c1 B0@c1 G1", loss_fn=nn.MSELoss())


def test_an_unknown_string_says_what_a_schedule_may_be() -> None:
    with pytest.raises(ValueError) as error:
        Pipe(model(), 2, stages=2, schedule="1fib", loss_fn=nn.MSELoss())
    message = str(error.value)
    assert "unknown schedule '1fib'" in message
    assert "a timetable as text" in message and "a path to a file" in message
    assert all(name in message for name in schedule_names())


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "mine.csv"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        Pipe(model(), 2, schedule=str(path), loss_fn=nn.MSELoss())


def test_a_schedule_of_another_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=re.escape(
            "schedule must be a name or a Schedule, got int (a timetable as text, or a path "
            "to a file holding one, works too)")):
        Pipe(model(), 2, stages=2, schedule=3, loss_fn=nn.MSELoss())  # type: ignore[arg-type]


@pytest.mark.parametrize("forwards", [
    "stage 0: F0 F1\nstage 1: F0@c1 F1@c1",
    Schedule.parse("stage 0: F0 F1\nstage 1: F0@c1 F1@c1"),
], ids=["text", "schedule"])
def test_a_forward_only_timetable_is_refused_for_training(forwards: object) -> None:
    # It used to build, and step() left no gradient at all.
    with pytest.raises(ScheduleError, match="runs forwards only"):
        Pipe(model(), 2, schedule=forwards, loss_fn=nn.MSELoss())


def test_torch_reads_our_csv_as_we_do() -> None:
    # torch.distributed.pipelining's own parser: '<stage index><op><micro-batch>' per cell,
    # where its stage index is our chunk and its rank (the row) our stage.
    from torch.distributed.pipelining.schedules import _Action

    schedule = get_schedule("zb-v", 2, 4)
    rows = to_csv(schedule).splitlines()
    for stage, (row, actions) in enumerate(zip(rows, schedule.order)):
        theirs = [_Action.from_str(cell) for cell in row.split(",")]
        assert [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in theirs] \
            == [(a.chunk, a.op.value, a.microbatch) for a in actions], stage
        assert {a.chunk for a in actions} == set(schedule.chunks_of_stage[stage])
