"""benchmarks/gpu_check.py on the CPU: its dry run, its watchdog, its budget, its no-CUDA exit.

The dry run and the watchdog run the script as users do; the budget and the no-CUDA exit
call its ``main`` in this process (a fresh interpreter importing torch costs seconds).
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def run(*arguments: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *arguments], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=timeout)


def run_here(*arguments: str) -> subprocess.CompletedProcess[str]:
    """``gpu_check.main(arguments)`` in this process, as ``run`` reports it: the exit code
    and what it printed (stdout and stderr)."""
    if str(SCRIPT.parent) not in sys.path:
        sys.path.append(str(SCRIPT.parent))  # last: nothing of the tests' is shadowed
    import gpu_check

    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = gpu_check.main(list(arguments))
    return subprocess.CompletedProcess([str(SCRIPT), *arguments], code, printed.getvalue(),
                                       errors.getvalue())


def lines(done: subprocess.CompletedProcess[str], prefix: str) -> list[str]:
    return [line for line in done.stdout.splitlines() if line.startswith(prefix)]


def test_the_dry_run_passes_every_schedule_and_mode_and_the_bf16_step() -> None:
    from schedules import schedule_names

    done = run("--cpu-dry-run")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    passed = {tuple(line.split()[2:4]) for line in lines(done, "[exact] PASS")}
    expected = {(name, mode) for name in schedule_names()
                for mode in ("always", "except_last", "never")}
    assert passed == expected, output[-4000:]
    assert lines(done, "[bf16] PASS bf16 loss agrees"), output[-4000:]
    assert lines(done, "[bf16] unpipelined") and lines(done, "[bf16] pipe (1f1b)")
    assert "ratio pipe/unpipelined" in done.stdout
    predicted = [line.split()[1] for line in lines(done, "[predict] ") if "(spread" in line]
    assert predicted == ["1f1b", "zb-h1", "interleaved-1f1b"], output[-4000:]
    split = lines(done, "[split] gpt: B ")
    assert len(split) == 1 and "(I+W)/B" in split[0] and "torch's" in split[0], output[-4000:]
    count = len(expected) + 1
    assert f"[summary] PASS {count}  FAIL 0  HANG 0  NOT RUN 0" in done.stdout, output[-4000:]
    assert done.stdout.rstrip().endswith("[summary] RESULT OK")


def test_a_stalled_rank_is_a_hang_and_fresh_ranks_run_the_rest() -> None:
    """Part 4's watchdog, and part 6 (the mesh, on four gloo ranks) after it."""
    done = run("--cpu-dry-run", "--gloo", "--schedules", "gpipe,1f1b,zb-v",
               "--stall-in", "1f1b", "--watchdog", "4")
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-4000:]
    ranks = [line.split()[:3] for line in lines(done, "[gloo] ")][1:]
    assert ranks == [["[gloo]", "PASS", "gpipe"], ["[gloo]", "HANG", "1f1b"],
                     ["[gloo]", "PASS", "zb-v"]], output[-4000:]
    meshes = [line.split()[1:5] for line in lines(done, "[mesh] PASS")]
    assert meshes == [["PASS", "(2,2,1)", "fsdp", "1f1b"], ["PASS", "(2,2,1)", "fsdp", "zb-v"],
                      ["PASS", "(2,2,1)", "replicate", "1f1b"]], output[-4000:]
    assert "[summary] PASS 15  FAIL 0  HANG 1" in done.stdout, output[-4000:]
    assert "[summary] RESULT FAILED" in done.stdout


def test_a_spent_budget_says_what_was_not_run() -> None:
    done = run_here("--cpu-dry-run", "--schedules", "1f1b", "--budget", "0")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert [line.split()[4] for line in lines(done, "[exact] NOT RUN")] == \
        ["always", "except_last", "never"], output[-4000:]
    assert lines(done, "[bf16] NOT RUN") and lines(done, "[predict] NOT RUN"), output[-4000:]
    assert lines(done, "[split] NOT RUN"), output[-4000:]
    assert "NOT RUN 6" in done.stdout and "[summary] RESULT INCOMPLETE" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the real check")
def test_without_cuda_there_is_nothing_to_check() -> None:
    done = run_here()
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert done.stdout.rstrip().endswith("no CUDA device: nothing to check")
