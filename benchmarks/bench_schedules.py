"""Time generating, validating, simulating and planning the communication of large timetables.

Run from the repository root:

    python benchmarks/bench_schedules.py                  # issue 43's table and bars
    python benchmarks/bench_schedules.py --repeat 3
    python benchmarks/bench_schedules.py --bars-only --repeat 3   # only the two bars' cases
    python benchmarks/bench_schedules.py --case gpipe 8 32 --case zb-v 8 64 --no-bars
    python benchmarks/bench_schedules.py --memory         # tracemalloc peaks too (slower)

Columns, in seconds (CPU, which other processes on a shared machine do not inflate):
``generate`` (``get_schedule``), ``validate``, ``simulate`` (with ``peak_activations``),
``comm plan`` (``comm_plan``) and ``proof`` (``validate_comm``, the NCCL-order proof);
``gc`` is one full ``gc.collect()`` with the timetable and its comm plan alive, in ms. Each
case starts from a fresh Schedule, so ``validate``'s cache never hides work. With
``--memory`` each case runs a second time under ``tracemalloc`` and prints its peak.

The bars of issue 43 (a benchmark, not a test; judged on the best of ``--repeat`` runs):

    zb-v P=64  M=1024  generate + validate + simulate + comm plan  < 2 s
    zb-v P=128 M=4096  each of generate, validate, simulate, comm plan < 10 s
    zb-v P=64  M=1024  gc.collect() with timetable and comm plan alive < 60 ms

Ends with a ``RESULT`` line giving, for the two bars' cases, each phase and the sum
(best of ``--repeat``). Exits with status 1 when a bar is missed. Uses only the public API,
so the same file measures an older checkout (``git worktree add /tmp/old <commit>``, then run it there).
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
import tracemalloc
from typing import Any

from schedules import comm_plan, get_schedule, simulate, validate, validate_comm

PHASES = ("generate", "validate", "simulate", "comm plan", "proof")
CASES: tuple[tuple[str, int, int], ...] = (
    ("1f1b", 64, 1024), ("zb-v", 64, 1024), ("interleaved-1f1b", 64, 512),
    ("zb-v", 64, 4096), ("zb-v", 128, 4096),
)
TOGETHER, EACH, COLLECT = ("zb-v", 64, 1024), ("zb-v", 128, 4096), ("zb-v", 64, 1024)


def bench(name: str, stages: int, microbatches: int) -> dict[str, float]:
    """CPU seconds of each phase on one fresh schedule, and a full collection's ms after."""
    phases: dict[str, float] = {}
    clock = [time.process_time()]

    def lap(phase: str) -> None:
        clock.append(time.process_time())
        phases[phase] = clock[-1] - clock[-2]

    schedule = get_schedule(name, stages, microbatches)
    lap("generate")
    validate(schedule)
    lap("validate")
    timeline = simulate(schedule, forward=1.0, backward=2.0)
    peaks = timeline.peak_activations
    lap("simulate")
    plan = comm_plan(schedule)
    lap("comm plan")
    validate_comm(plan)
    lap("proof")
    del timeline
    phases["gc"] = _collect_ms()
    phases["actions"] = float(sum(len(schedule.order[stage]) for stage in range(stages)))
    phases["peak activations"] = max(peaks)
    del plan, schedule
    gc.collect()
    return phases


def _collect_ms() -> float:
    """The best of three full collections, in milliseconds of wall time."""
    gc.collect()
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def memory_peak(name: str, stages: int, microbatches: int) -> float:
    """The most bytes Python held at once (tracemalloc) over all five phases, in MiB."""
    gc.collect()
    tracemalloc.start()
    schedule = get_schedule(name, stages, microbatches)
    validate(schedule)
    simulate(schedule, forward=1.0, backward=2.0).peak_activations
    validate_comm(comm_plan(schedule))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del schedule
    gc.collect()
    return peak / 2**20


def bars(best: dict[tuple[str, int, int], dict[str, float]]) -> list[str]:
    """The bars missed, as sentences (empty: all met, or their cases not run)."""
    missed = []
    if TOGETHER in best:
        total = sum(best[TOGETHER][phase] for phase in PHASES[:4])
        if total >= 2.0:
            missed.append(f"zb-v P=64 M=1024: generate..comm plan {total:.2f} s, bar 2 s")
    if EACH in best:
        for phase in PHASES[:4]:
            if best[EACH][phase] >= 10.0:
                missed.append(f"zb-v P=128 M=4096: {phase} {best[EACH][phase]:.2f} s, bar 10 s")
    if COLLECT in best and best[COLLECT]["gc"] >= 60.0:
        missed.append(f"zb-v P=64 M=1024: gc.collect() {best[COLLECT]['gc']:.0f} ms, bar 60 ms")
    return missed


def result_line(best: dict[tuple[str, int, int], dict[str, float]]) -> str:
    """One line with both bars' figures: each phase of the two cases and their sums."""
    cells = []
    for case in (TOGETHER, EACH):
        figures = best[case]
        phases = " ".join(f"{phase.replace(' ', '_')}={figures[phase]:.2f}" for phase in PHASES[:4])
        together = sum(figures[phase] for phase in PHASES[:4])
        cells.append(f"{case[0]} P={case[1]} M={case[2]}: {phases} sum={together:.2f}")
    return "RESULT CPU s (bars: P=64 sum < 2, P=128 each < 10): " + "; ".join(cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--case", nargs=3, action="append", metavar=("NAME", "P", "M"),
                        help="a schedule name, stages and micro-batches (repeatable)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case")
    parser.add_argument("--no-bars", action="store_true", help="time only the --case cases")
    parser.add_argument("--bars-only", action="store_true",
                        help="time only the bars' two cases (and any --case)")
    parser.add_argument("--memory", action="store_true", help="tracemalloc peaks (a second run)")
    args = parser.parse_args(argv)
    cases = [] if args.no_bars else [TOGETHER, EACH] if args.bars_only else list(CASES)
    cases += [(name, int(p), int(m)) for name, p, m in args.case or []]

    print("CPU seconds; gc: one full gc.collect() with timetable + comm plan alive, ms")
    header = " ".join(f"{phase:>9}" for phase in PHASES)
    print(f"{'schedule':<17} {'P':>3} {'M':>5} {'actions':>9} {header} {'g+v+s+c':>8} "
          f"{'gc ms':>7}" + (f" {'peak MiB':>9}" if args.memory else ""))
    best: dict[tuple[str, int, int], dict[str, float]] = {}
    for case in cases:
        for _ in range(args.repeat):
            figures = bench(*case)
            kept = best.setdefault(case, dict(figures))
            for key, value in figures.items():
                kept[key] = min(kept[key], value)
            _print_row(case, figures, memory_peak(*case) if args.memory else None)
    missed = [] if args.no_bars else bars(best)
    if TOGETHER in best and EACH in best:
        print(result_line(best))
    for sentence in missed:
        print("  missed:", sentence)
    print("a bar was missed" if missed else "within the bars" if not args.no_bars else "")
    return 1 if missed else 0


def _print_row(case: tuple[str, int, int], figures: dict[str, Any], peak: float | None) -> None:
    cells = " ".join(f"{figures[phase]:>9.2f}" for phase in PHASES)
    together = sum(figures[phase] for phase in PHASES[:4])
    memory = "" if peak is None else f" {peak:>9.0f}"
    print(f"{case[0]:<17} {case[1]:>3} {case[2]:>5} {int(figures['actions']):>9,} {cells} "
          f"{together:>8.2f} {figures['gc']:>7.1f}{memory}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
