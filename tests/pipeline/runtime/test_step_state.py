"""A step is a unit: a failed step leaves no half state, and accumulation stays exact.

A layer raising at micro-batch 3 of 8 leaves ``.grad`` (the very tensors) and BatchNorm's
running statistics as they were before the step, says so in the error, and the next step
without ``zero_grad`` accumulates exactly; two steps without ``zero_grad`` on a head tied
to the embedding across ranks add up to two plain backward passes (the cross-stage sum
counts each step's part once). In one process and on 2 gloo ranks.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import step_state_workers as workers
from dist_harness import in_turn, run_ranks
from pipeline import Pipe
from pipeline.runtime.step_state import NOTE

TOLERANCE = 1e-10
SCHEDULES = ("1f1b", "zb-h1", "gpipe")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_failed_step_leaves_gradients_and_statistics_as_before_in_one_process(schedule: str) -> None:
    model = workers.faulty_model()
    x, y = workers.batch()
    loss_fn = nn.CrossEntropyLoss()
    untroubled = copy.deepcopy(model)  # BatchNorm: the reference is the pipeline, unfailed
    reference = Pipe(untroubled, workers.CHUNKS, balance=[3, 4], devices=["cpu", "cpu"],
                     schedule=schedule, checkpoint="never", loss_fn=loss_fn)
    for _ in range(2):
        reference.step(x, y)
    expected = {key: p.grad for key, p in workers.per_layer(untroubled).items()}
    pipe = Pipe(model, workers.CHUNKS, balance=[3, 4], devices=["cpu", "cpu"], schedule=schedule,
                checkpoint="never", loss_fn=loss_fn)
    pipe.step(x, y)
    grads = {name: p.grad for name, p in model.named_parameters()}
    values = {name: g.clone() for name, g in grads.items()}
    statistics = [b.clone() for b in model.buffers()]
    model[4].armed = True
    with pytest.raises(Exception, match="a bad micro-batch") as raised:
        pipe.step(x, y)
    model[4].armed = False
    assert NOTE in getattr(raised.value, "__notes__", [])
    for name, p in model.named_parameters():
        assert p.grad is grads[name] and torch.equal(p.grad, values[name]), name
    for buffer, before in zip(model.buffers(), statistics):
        assert torch.equal(buffer, before)
    pipe.step(x, y)  # accumulates onto the first step's gradients
    assert workers.worst(model, expected) < TOLERANCE
    for buffer, after in zip(model.buffers(), untroubled.buffers()):
        assert torch.equal(buffer, after)


def test_a_successful_step_accumulates_into_the_same_tensors() -> None:
    model = workers.faulty_model()
    x, y = workers.batch()
    pipe = Pipe(model, 4, balance=[3, 4], devices=["cpu", "cpu"], loss_fn=nn.CrossEntropyLoss())
    pipe.step(x, y)
    before = {name: p.grad for name, p in model.named_parameters()}
    pipe.step(x, y)
    assert all(p.grad is before[name] for name, p in model.named_parameters())


@pytest.fixture(scope="module")
def on_ranks() -> dict[tuple[str, str], Any]:
    """Every 2-rank case, by (worker, schedule), from one spawn of 2 ranks (each spawn
    costs seconds), the cases in turn; a failed step leaves messages in flight on its
    group, a fresh one, and the world group's cases go first all the same."""
    cases = [("tied", "1f1b"), ("tied", "zb-h1"), ("tied", "zb-v"), ("failed", "1f1b"),
             ("failed", "zb-h1")]
    functions = {"tied": workers.tied_accumulation, "failed": workers.failed_step}
    calls = [(functions[name], (schedule,)) for name, schedule in cases]
    per_rank = run_ranks(in_turn, 2, calls, timeout=240)
    return {case: [results[index] for results in per_rank] for index, case in enumerate(cases)}


@pytest.mark.parametrize("schedule", ("1f1b", "zb-h1", "zb-v"))
def test_tied_weights_accumulate_exactly_across_ranks(
        on_ranks: dict[tuple[str, str], Any], schedule: str) -> None:
    for difference in on_ranks["tied", schedule]:
        assert difference < TOLERANCE


@pytest.mark.parametrize("schedule", ("1f1b", "zb-h1"))
def test_a_failed_step_leaves_every_rank_as_before(
        on_ranks: dict[tuple[str, str], Any], schedule: str) -> None:
    for same_grads, same_statistics, message, difference in on_ranks["failed", schedule]:
        assert same_grads and same_statistics, message
        assert NOTE in message
        assert difference < TOLERANCE


def test_tied_accumulation_in_one_process() -> None:
    model = workers.tied_model()
    x, y = workers.tokens()
    expected = workers.reference_two_steps(copy.deepcopy(model), x, y, workers.lm_loss)
    pipe = Pipe(model, workers.CHUNKS, balance=[2, 3], devices=["cpu", "cpu"], schedule="zb-h1",
                checkpoint="never", loss_fn=workers.lm_loss)
    for _ in range(2):
        pipe.step(x, y)
    assert workers.worst(model, expected) < TOLERANCE


INTERRUPTED = """
import sys, torch
from torch import nn
from pipeline import Pipe
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
pipe = Pipe(model, chunks=8, balance=[4, 4], devices=["cpu", "cpu"], loss_fn=nn.MSELoss(),
            schedule=sys.argv[1])
x, y = torch.randn(256, 512), torch.randn(256, 512)
pipe.step(x, y)
print("stepping", flush=True)
while True:
    pipe.step(x, y)
"""


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_ctrl_c_ends_a_one_process_step_and_the_program_cleanly(schedule: str, tmp_path) -> None:
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED)
    root = Path(__file__).resolve().parents[3]
    process = subprocess.Popen([sys.executable, str(script), schedule], cwd=root,
                               env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               # as a terminal starts it: an ignored SIGINT in this process
                               # (another test's leftover) would be inherited
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "stepping"
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()  # a failed or interrupted test leaves no program stepping forever
    assert time.monotonic() - interrupted < 10
    assert process.returncode == -signal.SIGINT, err[-2000:]
    assert "terminate called" not in err and "KeyboardInterrupt" in err


def test_ctrl_c_between_two_stage_starts_leaves_no_stage_waiting(monkeypatch) -> None:
    """Ctrl-C can land while the stage threads start (found by interrupting a stepping
    program 25 times: once the started stage waited for the other forever, and the
    interpreter's exit with it). Interrupted right after stage 0 starts, the step raises,
    no stage thread is left, ``.grad`` is as before, and the next step accumulates exactly."""
    import threading
    import time

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]).double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    pipe = Pipe(model, 4, balance=[2, 2], devices=["cpu", "cpu"], loss_fn=nn.MSELoss())
    pipe.step(x, y)
    nn.MSELoss()(reference(x), y).backward()
    before = {name: (p.grad, p.grad.clone()) for name, p in model.named_parameters()}
    start = threading.Thread.start

    def interrupted_after_the_first_stage(thread: threading.Thread) -> None:
        start(thread)
        if thread.name == "pipesched-stage-0":
            raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", interrupted_after_the_first_stage)
    with pytest.raises(KeyboardInterrupt):
        pipe.step(x, y)
    monkeypatch.undo()
    deadline = time.monotonic() + 10
    while any(t.name.startswith("pipesched-stage") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a stage thread still waits after Ctrl-C"
        time.sleep(0.05)
    for name, p in model.named_parameters():
        assert p.grad is before[name][0] and torch.equal(p.grad, before[name][1]), name
    pipe.step(x, y)
    nn.MSELoss()(reference(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=TOLERANCE)
    pipe.close()
