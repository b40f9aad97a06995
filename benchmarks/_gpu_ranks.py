"""Part 4 of gpu_check.py: every schedule on two spawned ranks, NCCL on GPUs (gloo dry run).

Each rank runs every schedule on a fresh process group and answers per schedule; the
parent's watchdog reports a schedule that makes no progress as HANG, kills the ranks and
starts fresh ones for the rest while the budget lasts.
"""

from __future__ import annotations

import copy
import os
import queue as queue_module
import time
import traceback
from typing import Any

import torch
from torch import nn

from _gpu_common import (EXACT_CPU, EXACT_GPU, TOLERANCE, Report, grad_error, join_group,
                         lm_loss, make_batch, make_gpt, rank_context, reference_grads, short)



def rank_main(rank: int, world: int, port: int, backend: str, schedules: list[str],
              stall_in: str | None, timeout: float, results: Any) -> None:
    """One spawned rank: every schedule on a fresh group; one answer per schedule."""
    try:
        device = join_group(rank, world, port, backend, timeout)
        sizes = EXACT_GPU if backend == "nccl" else EXACT_CPU
        model = make_gpt(sizes, torch.float64)
        x, y = make_batch(sizes)
        expected = reference_grads(model, x, y, device)
        for name in schedules:
            if name == stall_in and rank == 1:
                time.sleep(3600)  # --stall-in: the watchdog must report this, not wait
            answer = rank_step(model, x, y, expected, name, sizes.chunks, timeout, device)
            results.put((rank, name, *answer))
    except BaseException as error:  # reported to the parent
        results.put((rank, None, "error", f"{short(error)}\n{traceback.format_exc()}", 0))
    finally:
        # Flush the answers, then leave without atexit handlers, which could block on a
        # process group whose peer is gone.
        results.close()
        results.join_thread()
        os._exit(0)


def rank_step(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, expected: dict[str, Any],
              name: str, chunks: int, timeout: float,
              device: torch.device) -> tuple[str, Any, int]:
    """("ok", max gradient error, tensors compared) or ("error", text, 0)."""
    import torch.distributed as dist

    from pipeline import Pipe

    try:
        group = dist.new_group([0, 1])  # messages a failed step left cannot reach the next
        trained = copy.deepcopy(model)
        pipe = Pipe(trained, chunks=chunks, schedule=name, loss_fn=lm_loss(),
                    group=group, timeout=timeout)
        rank = dist.get_rank()
        first, last = (pipe.schedule.placement[i] == rank for i in (0, -1))
        pipe.step(x.to(device) if first else None, y.to(device) if last else None)
        error, compared = grad_error(trained, expected)
        return "ok", error, compared
    except Exception as error:  # noqa: BLE001 - one schedule's failure, reported
        return "error", short(error), 0


def judge(report: Report, part: str, name: str,
          answers: dict[int, tuple[str, Any, int]]) -> None:
    """PASS when both ranks held gradients and each is within the tolerance."""
    if all(status == "ok" for status, _, _ in answers.values()):
        worst = max(value for _, value, _ in answers.values())
        counts = ", ".join(f"rank {r}: {answers[r][2]}" for r in sorted(answers))
        held = all(answers[r][2] > 0 for r in answers)
        verdict = "PASS" if worst < TOLERANCE and held else "FAIL"
        report.outcome(part, verdict, f"{name:<16}",
                       f"max abs grad error {worst:.1e} (tensors {counts})")
    else:
        errors = "; ".join(f"rank {r}: {answers[r][1]}" for r in sorted(answers)
                           if answers[r][0] != "ok")
        report.outcome(part, "FAIL", f"{name:<16}", errors)


class Ranks:
    """Two spawned ranks running ``schedules``, and their answers by schedule and rank."""

    def __init__(self, backend: str, schedules: list[str], stall_in: str | None,
                 timeout: float) -> None:
        from pipeline.launching import free_port

        context = rank_context()
        self.results = context.Queue()
        port = free_port()
        self.processes = [
            context.Process(target=rank_main, daemon=True, args=(
                rank, 2, port, backend, schedules, stall_in, timeout, self.results))
            for rank in range(2)
        ]
        for process in self.processes:
            process.start()
        self.answers: dict[str, dict[int, tuple[str, Any, int]]] = {n: {} for n in schedules}

    def wait_for(self, name: str, report: Report, deadline: float) -> str:
        """``"done"``, ``"hang"``, ``"budget"``, ``"dead: ..."`` or ``"start-up: ..."``."""
        while len(self.answers[name]) < 2:
            if time.monotonic() > deadline:
                return "hang"
            if report.left() <= 0:
                return "budget"
            try:
                rank, answered, *answer = self.results.get(timeout=0.2)
            except queue_module.Empty:
                # A rank flushes its answers before it exits: a dead one that has not
                # answered by now never will.
                dead = [f"rank {r} (exit code {p.exitcode})"
                        for r, p in enumerate(self.processes)
                        if not p.is_alive() and r not in self.answers[name]]
                if dead:
                    return f"dead: {', '.join(dead)} ended without an answer"
                continue
            if answered is None:  # a rank failed outside any schedule
                return f"start-up: rank {rank}: {answer[1]}"
            self.answers[answered][rank] = (answer[0], answer[1], answer[2])
        return "done"

    def missing(self, name: str) -> list[int]:
        return sorted(set(range(2)) - set(self.answers[name]))

    def close(self, hung: bool = False) -> None:
        """End the ranks: those that finished get 2 s to leave; hung ones are killed at once."""
        from pipeline.launching import end_processes

        end_processes(self.processes, grace=0.0 if hung else 2.0)


def launch_ranks(report: Report, backend: str, schedules: list[str], stall_in: str | None,
                 timeout: float, watchdog: float, startup: float) -> list[str]:
    """Run ``schedules`` on two fresh ranks; return those left to run after a HANG."""
    ranks = Ranks(backend, schedules, stall_in, timeout)
    deadline = time.monotonic() + startup + watchdog  # the first also waits for start-up
    state = "done"
    try:
        for index, name in enumerate(schedules):
            state = ranks.wait_for(name, report, deadline)
            if state == "done":
                judge(report, backend, name, ranks.answers[name])
                deadline = time.monotonic() + watchdog
                continue
            if state == "hang":
                report.outcome(backend, "HANG", f"{name:<16}",
                               f"no answer from rank(s) {ranks.missing(name)} in "
                               f"{watchdog:.0f} s; ranks killed, fresh ones for the rest")
                return schedules[index + 1:]
            if state.startswith("dead"):
                report.outcome(backend, "FAIL", f"{name:<16}",
                               f"{state[6:]}; fresh ranks for the rest")
                return schedules[index + 1:]
            why = ""
            if state.startswith("start-up"):  # every schedule would fail alike
                report.outcome(backend, "FAIL", "start-up", state[10:])
                why = "the ranks did not start"
            for rest in schedules[index:]:
                report.skip(backend, rest, why)
            return []
        return []
    finally:
        ranks.close(hung=state == "hang")


def two_ranks(report: Report, backend: str, schedules: list[str], stall_in: str | None,
              watchdog: float | None) -> None:
    """Part 4: every schedule on two ranks, relaunching after a HANG while the budget lasts."""
    if backend == "nccl" and torch.cuda.device_count() < 2:
        report.line("nccl", f"skipped: {torch.cuda.device_count()} GPU here, and NCCL refuses "
                            "two ranks on one GPU (duplicate GPU detected), so the NCCL runtime "
                            "cannot be checked on this machine")
        return
    timeout, default, startup = (30.0, 45.0, 60.0) if backend == "nccl" else (8.0, 12.0, 30.0)
    watchdog = default if watchdog is None else watchdog
    report.line(backend, f"2 {backend} ranks, GPT float64 M={EXACT_CPU.chunks}, checkpoint "
                        f"except_last; watchdog {watchdog:.0f} s per schedule")
    remaining = list(schedules)
    while remaining:
        if report.left() < watchdog + startup:
            for name in remaining:
                report.skip(backend, name)
            return
        remaining = launch_ranks(report, backend, remaining, stall_in, timeout, watchdog,
                                 startup)
