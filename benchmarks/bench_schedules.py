"""Time generating, validating and simulating large GPipe and 1F1B schedules.

Run from the repository root:

    python benchmarks/bench_schedules.py                 # P=64, M=1024: 131,072 actions
    python benchmarks/bench_schedules.py --repeat 3 --stages 8 --microbatches 32

Each phase starts from a fresh Schedule, so ``validate``'s cache never hides the
work. ``simulate`` runs on the validated schedule, as a caller would. The script
exits with status 1 when a schedule's total exceeds ``--budget`` seconds.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable

from schedules import Schedule, gpipe, one_f_one_b, simulate, validate

GENERATORS: dict[str, Callable[[int, int], Schedule]] = {"1f1b": one_f_one_b, "gpipe": gpipe}


def bench(name: str, stages: int, microbatches: int) -> dict[str, float]:
    """Seconds for each phase on one schedule, plus its total and a check of the result."""
    generator = GENERATORS[name]
    clock = time.perf_counter

    started = clock()
    schedule = generator(stages, microbatches)
    generated = clock()
    validate(schedule)
    validated = clock()
    timeline = simulate(schedule, forward=1.0, backward=2.0)
    simulated = clock()
    peaks = timeline.peak_activations
    measured = clock()

    # The figures must be right, or the speed means nothing.
    expected_bubble = (stages - 1) / (microbatches + stages - 1)
    if not math.isclose(timeline.bubble_fraction, expected_bubble, rel_tol=1e-12):
        raise SystemExit(f"{name}: bubble {timeline.bubble_fraction} != {expected_bubble}")
    expected_makespan = 3 * (microbatches + stages - 1)
    if timeline.makespan != expected_makespan:
        raise SystemExit(f"{name}: makespan {timeline.makespan} != {expected_makespan}")
    expected_peak = microbatches if name == "gpipe" else min(stages, microbatches)
    if peaks[0] != expected_peak:
        raise SystemExit(f"{name}: stage 0 holds {peaks[0]}, expected {expected_peak}")

    return {
        "actions": float(sum(len(actions) for actions in schedule.order)),
        "generate": generated - started,
        "validate": validated - generated,
        "simulate": simulated - validated,
        "total": simulated - started,
        "peak_activations": measured - simulated,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=1, help="runs per schedule")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds allowed per total")
    parser.add_argument("--schedules", nargs="+", default=list(GENERATORS), choices=GENERATORS)
    args = parser.parse_args(argv)

    print(f"P={args.stages} M={args.microbatches}; seconds; total = generate + validate + "
          f"simulate (budget {args.budget:g} s); peak_activations is extra")
    header = f"{'schedule':<8} {'run':>3} {'actions':>8} {'generate':>9} {'validate':>9} " \
             f"{'simulate':>9} {'total':>7} {'peak_act':>9}"
    print(header)
    over = False
    for name in args.schedules:
        for run in range(1, args.repeat + 1):
            figures = bench(name, args.stages, args.microbatches)
            over |= figures["total"] > args.budget
            print(f"{name:<8} {run:>3} {int(figures['actions']):>8} {figures['generate']:>9.3f} "
                  f"{figures['validate']:>9.3f} {figures['simulate']:>9.3f} "
                  f"{figures['total']:>7.3f} {figures['peak_activations']:>9.3f}")
    print("over budget" if over else "within budget")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
