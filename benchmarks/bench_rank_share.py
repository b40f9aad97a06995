"""What one rank keeps of a ZB-V timetable, and what a full garbage collection costs with it.

    python benchmarks/bench_rank_share.py [--stages 16 32 64] [--per-stage 16] [--stage middle]

For ZB-V at each P with M = per-stage x P (fixed M/P), builds what ``DistRunner`` keeps on
one rank (``pipeline.runtime.rank_share.rank_share``: its stage's training and forward-only
steps; the whole comm plans built, proven and dropped) beside the schedule the Pipe keeps,
and prints:

- ``build s``: seconds of ``rank_share`` (two comm plans and their proofs, then the part);
- ``objects``: gc-tracked objects the share holds (the live objects' count after it is
  built, less before; the schedule, the Pipe's, built before);
- ``bytes``: bytes it holds (tracemalloc, after the whole plans are dropped);
- ``gc ms (share)``: one full ``gc.collect()`` with the share alive, the process's own
  objects (torch, the library, the schedule) frozen first (``gc.freeze``), so that it counts
  what the share adds; ``gc ms (process)``: the same with nothing frozen, the whole
  process as a rank would run it (torch alone costs most of it; ``gc.freeze()`` after
  imports is the user's call, not the library's).

Then, at the largest P, the old way: the whole timetable and both whole comm plans alive
(``runtime.runner.Plans``, every stage's part derived), their objects and a full
collection. Issue 43's bars: a rank's full collection under 20 ms at P=64, M=1024; with
the whole timetable and plan alive, under 60 ms.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import torch  # noqa: F401  the process a rank runs: torch and the library imported

from schedules import Schedule, get_schedule

from pipeline.runtime.rank_share import rank_share
from pipeline.runtime.runner import Plans


def collect_ms(repeat: int = 5) -> float:
    """The median milliseconds of a full ``gc.collect()``."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        gc.collect()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def held(build: Callable[[], Any]) -> tuple[Any, int, int, float]:
    """``build()``'s result, the gc-tracked objects and bytes it holds, and the seconds of
    a build without tracemalloc (which slows allocations several times)."""
    start = time.perf_counter()
    value = build()
    seconds = time.perf_counter() - start
    del value
    gc.collect()
    before = len(gc.get_objects())
    tracemalloc.start()
    value = build()
    gc.collect()
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return value, len(gc.get_objects()) - before, size, seconds


def measure_share(schedule: Schedule, stage: int) -> dict[str, float]:
    """One rank's share of ``schedule``: objects, bytes, build seconds, collection times."""
    schedule.split_backward  # the Pipe's schedule's own cache, made before any step
    share, objects, size, seconds = held(lambda: rank_share(schedule, stage))
    process = collect_ms()
    del share
    gc.collect()
    gc.freeze()  # everything but the share: torch, the library, the schedule
    try:
        share = rank_share(schedule, stage)
        alone = collect_ms()
        del share
    finally:
        gc.unfreeze()
    return {"build": seconds, "objects": objects, "bytes": size, "alone": alone,
            "process": process}


def measure_whole(schedule: Schedule) -> dict[str, float]:
    """The whole timetable and both whole comm plans alive, every stage's part derived."""
    def build() -> Plans:
        plans = Plans(schedule)
        for stage in range(schedule.stages):
            plans.stage(stage, infer=False)
            plans.stage(stage, infer=True)
        return plans

    plans, objects, size, seconds = held(build)
    process = collect_ms()
    del plans
    return {"build": seconds, "objects": objects, "bytes": size, "process": process}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--per-stage", type=int, default=16, help="M / P")
    parser.add_argument("--no-whole", action="store_true", help="skip the whole-plan figures")
    arguments = parser.parse_args()
    print(f"baseline: gc.collect() {collect_ms():.1f} ms with torch and the library imported, "
          f"{len(gc.get_objects())} objects")
    print(f"{'P':>3} {'M':>5} {'stage':>5} {'build s':>8} {'objects':>8} {'MiB':>7} "
          f"{'gc ms (share)':>13} {'gc ms (process)':>15}")
    largest = None
    for stages in arguments.stages:
        schedule = get_schedule("zb-v", stages, arguments.per_stage * stages)
        stage = stages // 2
        found = measure_share(schedule, stage)
        print(f"{stages:>3} {schedule.microbatches:>5} {stage:>5} {found['build']:>8.2f} "
              f"{int(found['objects']):>8} {found['bytes'] / 2**20:>7.2f} "
              f"{found['alone']:>13.1f} {found['process']:>15.1f}", flush=True)
        largest = schedule
    if largest is not None and not arguments.no_whole:
        whole = measure_whole(largest)
        print(f"whole timetable and comm plans alive (P={largest.stages}, "
              f"M={largest.microbatches}): {int(whole['objects'])} objects, "
              f"{whole['bytes'] / 2**20:.1f} MiB, gc.collect() {whole['process']:.1f} ms "
              f"(built in {whole['build']:.1f} s)")


if __name__ == "__main__":
    main()
