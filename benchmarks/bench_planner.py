"""Time the planner (``partitioners.plan.search.plan``) on known costs as the stages grow.

    python benchmarks/bench_planner.py [--stages 4 8 16 32] [--layers-per-stage 4]
                                       [--batch-per-stage 32] [--memory-limit]

For each P: a model of ``layers-per-stage x P`` equal layers (costs scaled linearly
from one size, ``plan.costs.linear_costs``), a batch of ``batch-per-stage x P`` rows, the
default search space (every registered schedule and its variants, the default
micro-batch counts, every recomputation mode). Prints the seconds of one ``plan`` call
(cold: its schedules built for the first time in this process), how many candidates it
simulated, how many the search space had, and the pick. With ``--memory-limit``, also
under a limit of 60% of the unlimited pick's peak (cuts by memory searched too).

Issue 43's bar: P=32 takes seconds, not minutes.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from partitioners import LayerCost
from partitioners.plan.costs import linear_costs
from partitioners.plan.search import Plan, plan


def known_costs(layers: int) -> Callable[[int], list[LayerCost]]:
    """Equal layers, a heavier last one (so cuts are not all trivially even)."""
    layer = LayerCost(forward=1e-3, backward=2e-3, param_bytes=4 << 20, saved_bytes=1 << 20)
    last = LayerCost(forward=2e-3, backward=4e-3, param_bytes=8 << 20, saved_bytes=2 << 20)
    return linear_costs([layer] * (layers - 1) + [last], rows=1)


def timed_plan(stages: int, layers: int, batch: int, memory_limit: float | None
               ) -> tuple[float, Plan]:
    """Seconds of one ``plan`` call, and its Plan."""
    start = time.perf_counter()
    found = plan(known_costs(layers), stages=stages, batch=batch, memory_limit=memory_limit)
    return time.perf_counter() - start, found


def space_size(stages: int, layers: int, batch: int) -> int:
    """How many candidates the default search space holds (an unpruned plan's count)."""
    return len(plan(known_costs(layers), stages=stages, batch=batch, prune=False).candidates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--layers-per-stage", type=int, default=4)
    parser.add_argument("--batch-per-stage", type=int, default=32)
    parser.add_argument("--memory-limit", action="store_true")
    parser.add_argument("--space", action="store_true",
                        help="also count the whole search space (an unpruned plan: slow)")
    arguments = parser.parse_args()
    print(f"{'P':>3} {'layers':>6} {'batch':>5} {'limit':>10} {'seconds':>8} "
          f"{'simulated':>9} {'space':>6}  pick")
    for stages in arguments.stages:
        layers = arguments.layers_per_stage * stages
        batch = arguments.batch_per_stage * stages
        seconds, found = timed_plan(stages, layers, batch, None)
        rows: list[tuple[float | None, float, Plan]] = [(None, seconds, found)]
        if arguments.memory_limit:
            limit = 0.6 * max(found.peak_memory)
            rows.append((limit, *timed_plan(stages, layers, batch, limit)))
        space = space_size(stages, layers, batch) if arguments.space else None
        for planned, seconds, picked in rows:
            shown = "none" if planned is None else f"{planned / 2**20:.0f} MiB"
            print(f"{stages:>3} {layers:>6} {batch:>5} {shown:>10} {seconds:>8.2f} "
                  f"{len(picked.candidates):>9} {'-' if space is None else space:>6}  "
                  f"{picked.describe()[:90]}", flush=True)


if __name__ == "__main__":
    main()
