"""bench_vs_torch --model: ours against torch on one model in fresh processes, launches
alternating, with our step's breakdown per rank (``pipeline.runtime.executor.StepMeter``).

``side_main`` runs on the ranks; it reads the BENCH_YIELD, BENCH_LOOKAHEAD and
BENCH_AHEAD_BYTES experiment knobs of our gloo transport (see bench_vs_torch.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import _vs_torch_model
from _rounds import median_ms, timed_between_barriers
from _spawn import LoadMonitor, run_ranks
from _vs_torch_model import BLOCKS, STAGES, use_model
from _vs_torch_ranks import Idle, Ours, OursThreads, Torch


def side_main(rank: int, world: int, model: str, side: str, schedule: str, microbatches: int,
              warmup: int, steps: int, trace: str | None) -> dict[str, Any]:
    """One side (ours or torch) in fresh processes: every step's time on this rank (barrier
    before each step), and for ours the step's breakdown from the executor's meter."""
    import torch
    import torch.distributed as dist

    from pipeline.runtime.executor import StepMeter

    torch.set_num_threads(1)
    use_model(model)
    runner: Any
    if side == "ours":
        runner = Ours(rank, microbatches, schedule, "never")
    elif side == "threads":
        runner = OursThreads(microbatches, schedule) if rank == 0 else Idle()
    else:
        runner = Torch(rank, microbatches, schedule)
    meter = StepMeter()
    if side == "ours":
        runner.pipe._runner.meter = meter
        if os.environ.get("BENCH_YIELD") is not None:  # an experiment: yield after sends or not
            runner.pipe._runner.transport.yield_after_send = os.environ["BENCH_YIELD"] == "1"
        if os.environ.get("BENCH_LOOKAHEAD") is not None:  # receives posted ahead, at least
            runner.pipe._runner.transport.receives.lookahead = int(os.environ["BENCH_LOOKAHEAD"])
        if os.environ.get("BENCH_AHEAD_BYTES") is not None:  # and more within these bytes
            runner.pipe._runner.transport.receives.ahead_bytes = int(os.environ["BENCH_AHEAD_BYTES"])
    for _ in range(warmup):
        timed_between_barriers(runner.step)
    meter.reset()
    times = []
    for _ in range(steps):
        dist.barrier()
        started = time.perf_counter()
        runner.step()
        times.append(time.perf_counter() - started)
        if hasattr(runner, "after_step"):
            runner.after_step()
    report: dict[str, Any] = {"times": times,
                              "grad_sq": runner.grad_sq() if hasattr(runner, "grad_sq") else 0.0}
    if side == "ours":
        report["meter"] = meter.per_step_ms()
        if trace and rank == 0 and runner.pipe.timeline is not None:
            runner.pipe.timeline.to_chrome_trace(trace)
    return report


def compare(args: argparse.Namespace) -> int:
    """``--model``: per schedule, ours and torch's launched in turn (A B A B ...), each launch
    a fresh pair of processes; a step's time is the slowest rank's, barrier to step end; each
    launch gives the median of its steps, and each side the median of its launches."""
    use_model(args.model)
    microbatches = args.microbatches[0] if args.microbatches != [4, 8, 16] else 8
    print(f"{BLOCKS} x (Linear({_vs_torch_model.WIDTH}), ReLU), batch {_vs_torch_model.BATCH}, "
          f"M={microbatches}, P={STAGES} gloo "
          f"ranks, 1 thread each; {args.launches} launches per side, alternating; "
          f"{args.steps_per_launch} steps per launch after {args.warmup_steps} warm-up steps")
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min average, {os.cpu_count()} cores)")
    met = True
    with LoadMonitor() as monitor:
        for schedule in args.schedules:
            sides = ("ours", "torch", "threads") if args.threads else ("ours", "torch")
            launches: dict[str, list[float]] = {side: [] for side in sides}
            meters: list[list[dict[str, float]]] = []
            for launch in range(args.launches):
                for side in sides:
                    reports = run_ranks(side_main, STAGES, args.model, side, schedule,
                                        microbatches, args.warmup_steps, args.steps_per_launch,
                                        args.trace if launch == 0 else None)
                    steps = [max(r["times"][i] for r in reports)
                             for i in range(len(reports[0]["times"]))]
                    launches[side].append(median_ms(steps))
                    if side == "ours":
                        mean = 1e3 * statistics.fmean(steps)
                        meters.append([{**r["meter"], "other": mean - r["meter"]["total"]}
                                       for r in reports])
            ours, theirs = statistics.median(launches["ours"]), statistics.median(launches["torch"])
            ratio = ours / theirs
            print(f"\n{schedule}: ours {ours:.2f} ms, torch {theirs:.2f} ms, ours/torch "
                  f"{ratio:.3f}   (launch medians: ours "
                  f"{' '.join(f'{v:.2f}' for v in launches['ours'])}; torch "
                  f"{' '.join(f'{v:.2f}' for v in launches['torch'])})")
            if args.threads:
                threads = statistics.median(launches["threads"])
                print(f"  ours in one process (a thread per stage): {threads:.2f} ms, "
                      f"/ torch {threads / theirs:.3f}   (launch medians: "
                      f"{' '.join(f'{v:.2f}' for v in launches['threads'])})")
            _print_breakdown(meters)
            bar = 0.8 if args.model == "tiny" else 0.9
            if schedule == "1f1b" and ratio > bar or ratio > 1.0:
                met = False
    print(f"\nother processes kept {monitor.mean():.2f} cores busy on average; load after: "
          f"{os.getloadavg()[0]:.2f}")
    print(f"bar (1f1b ours/torch <= {0.8 if args.model == 'tiny' else 0.9}, every schedule <= 1):"
          f" {'MET' if met else 'MISSED'}")
    return 0 if met else 1


def _print_breakdown(meters: list[list[dict[str, float]]]) -> None:
    """Per rank, the medians over launches of our step's parts (ms per step, means over a
    launch's steps)."""
    parts = ("compute", "wait", "post", "collective", "overhead", "total", "other")
    print(f"  ours, ms/step: {' '.join(f'{p:>10}' for p in parts)}")
    for rank in range(len(meters[0])):
        values = {p: statistics.median(m[rank][p] for m in meters) for p in parts}
        print(f"  rank {rank:<8} {' '.join(f'{values[p]:10.2f}' for p in parts)}")
    print("  compute: the actions (their events); wait: in transport.take and finish (a peer's "
          "message, unpacking); post: in transport.post and begin_step (sends, the yield after "
          "each, receives posted ahead); "
          "collective: the end of the step (reading the loss the backward messages brought, "
          "posting the timeline's background gather; shared and data-parallel gradients); "
          "overhead: the rest of the runner's step (executor, begin_step, step_of, "
          "input gradients); total: the runner's step; other: the benchmark's step (mean of the "
          "slowest rank's, from a barrier) minus total (Pipe.step's checks and split, leaving "
          "the barrier)")
