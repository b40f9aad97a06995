"""Time generating, validating, simulating and counting peak activations of large schedules.

Run from the repository root:

    python benchmarks/bench_schedules.py                  # the two bars of issue 12
    python benchmarks/bench_schedules.py --repeat 3
    python benchmarks/bench_schedules.py --case gpipe 8 32 --case zb-v 8 64 --no-bars

The bars (a benchmark, not a test): ``simulate`` plus ``Timeline.peak_activations``
on a validated schedule, as a caller that already validated it sees them, within

    1f1b  P=64 M=1024 (131,072 actions)    1 s
    zb-v  P=64 M=4096 (1,572,864 actions)  10 s

Generation and validation are timed and printed too, but belong to the generators
and the validator. Each case starts from a fresh Schedule, so ``validate``'s cache
never hides work. Wall-clock and CPU seconds are both printed; the bars are judged
on the best CPU seconds of ``--repeat`` runs, which other processes on a shared
machine do not inflate (on an idle machine the two agree). Exits with status 1
when a bar is missed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from schedules import Schedule, get_schedule, simulate, validate

BARS: dict[tuple[str, int, int], float] = {("1f1b", 64, 1024): 1.0, ("zb-v", 64, 4096): 10.0}


def bench(name: str, stages: int, microbatches: int) -> dict[str, float]:
    """Wall and CPU seconds of each phase on one fresh schedule, after checking its figures."""
    phases: dict[str, float] = {}
    marks = [(time.perf_counter(), time.process_time())]

    def lap(phase: str) -> None:
        marks.append((time.perf_counter(), time.process_time()))
        phases[phase] = marks[-1][0] - marks[-2][0]
        phases[f"{phase} cpu"] = marks[-1][1] - marks[-2][1]

    schedule = get_schedule(name, stages, microbatches)
    lap("generate")
    validate(schedule)
    lap("validate")
    timeline = simulate(schedule, forward=1.0, backward=2.0)
    lap("simulate")
    peaks = timeline.peak_activations
    lap("peak")
    _check(name, schedule, timeline.makespan, timeline.bubble_fraction, peaks)
    phases["actions"] = float(sum(len(actions) for actions in schedule.order))
    return phases


def _check(
    name: str, schedule: Schedule, makespan: float, bubble: float, peaks: tuple[float, ...]
) -> None:
    """The figures must be right, or the speed means nothing."""
    stages, microbatches = schedule.stages, schedule.microbatches
    if name in ("gpipe", "1f1b"):
        expected_bubble = (stages - 1) / (microbatches + stages - 1)
        if not math.isclose(bubble, expected_bubble, rel_tol=1e-12):
            raise SystemExit(f"{name}: bubble {bubble} != {expected_bubble}")
        if makespan != 3 * (microbatches + stages - 1):
            raise SystemExit(f"{name}: makespan {makespan} != {3 * (microbatches + stages - 1)}")
        expected_peak = microbatches if name == "gpipe" else min(stages, microbatches)
        if peaks[0] != expected_peak:
            raise SystemExit(f"{name}: stage 0 holds {peaks[0]}, expected {expected_peak}")
    elif max(peaks) > stages:
        raise SystemExit(f"{name}: a stage holds {max(peaks)} micro-batches, more than {stages}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs=3, action="append", metavar=("NAME", "P", "M"),
                        help="a schedule name, stages and micro-batches (repeatable)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case")
    parser.add_argument("--no-bars", action="store_true", help="time only the --case cases")
    args = parser.parse_args(argv)
    cases = [] if args.no_bars else list(BARS)
    cases += [(name, int(p), int(m)) for name, p, m in args.case or []]

    print("seconds, wall (cpu); bar: cpu of simulate + peak_activations on a validated schedule")
    print(f"{'schedule':<10} {'P':>3} {'M':>5} {'actions':>9} {'generate':>14} {'validate':>14} "
          f"{'simulate':>14} {'peak':>14} {'cpu s+p':>8} {'bar':>5}")
    missed = False
    for case in cases:
        best = math.inf
        for _ in range(args.repeat):
            f = bench(*case)
            measured = f["simulate cpu"] + f["peak cpu"]
            best = min(best, measured)
            cells = " ".join(f"{f[p]:>6.2f} ({f[p + ' cpu']:>5.2f})"
                             for p in ("generate", "validate", "simulate", "peak"))
            print(f"{case[0]:<10} {case[1]:>3} {case[2]:>5} {int(f['actions']):>9} {cells} "
                  f"{measured:>8.2f} {BARS[case] if case in BARS else '-':>5}", flush=True)
        if case in BARS and best > BARS[case]:
            missed = True
            print(f"  {case[0]} P={case[1]} M={case[2]}: best {best:.2f} CPU s misses the "
                  f"{BARS[case]:g} s bar")
    print("a bar was missed" if missed else "within the bars")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
