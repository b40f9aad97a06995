"""Timing steps on gloo ranks: barrier to barrier, in rounds until every runner has enough
quiet steps (shared by bench_vs_torch and bench_schedules_measured)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

QUIET_CORES = 0.25  # a step during which other processes used more cores than this is dropped
MIN_QUIET = 8  # quiet steps wanted per runner and M before the rounds stop


def median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def timed_between_barriers(step: Callable[[], None]) -> tuple[float, float]:
    """(start, end) of one step, barrier to barrier, in ``time.perf_counter`` seconds."""
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    step()
    dist.barrier()
    return started, time.perf_counter()


def measure_rounds(rank: int, runners: dict[str, Any], steps: int, rounds: int, seconds: float,
                   load: Any) -> dict[str, list[tuple[float, float]]]:
    """Rounds of ``steps`` steps per runner, at least ``rounds``, then on until every runner
    has MIN_QUIET steps that others' load (``load.value``, cores) probably left alone, or
    ``seconds`` have passed. The parent sorts the steps out precisely afterwards."""
    import torch
    import torch.distributed as dist

    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    quiet = dict.fromkeys(runners, 0)
    deadline = time.perf_counter() + seconds
    done = torch.zeros(1)
    count = 0
    while not done.item():
        for name, runner in runners.items():
            for _ in range(steps):
                before = load.value
                start, end = timed_between_barriers(runner.step)
                samples[name].append((start, end))
                if hasattr(runner, "after_step"):
                    runner.after_step()
                quiet[name] += max(before, load.value) <= QUIET_CORES
        count += 1
        if rank == 0:
            enough = min(quiet.values()) >= MIN_QUIET or time.perf_counter() > deadline
            done.fill_(float(count >= rounds and enough))
        dist.broadcast(done, 0)  # rank 0 decides for both
    return samples
