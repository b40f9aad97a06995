"""Time ``balance`` on 20,000 layers into 64 stages: by time, with send costs, memory-capped.

    python benchmarks/bench_balance.py [--layers 20000] [--stages 64] [--repeat 3]

Prints the best of ``--repeat`` runs for each variant, in seconds. The first line is the
figure a unit test used to bound (20,000 plain weights into 64 stages, seed 3, "under a
second"): a speed is measured here, not asserted by the tests, where a loaded machine
failed it (2.2 s).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from partitioners import LayerCost, balance, held_microbatches, stage_memory


def best_of(repeat: int, run: Callable[[], list[int]]) -> tuple[float, list[int]]:
    """The fastest of ``repeat`` runs, in seconds, and the cut it returned."""
    best, sizes = float("inf"), []
    for _ in range(repeat):
        start = time.perf_counter()
        sizes = run()
        best = min(best, time.perf_counter() - start)
    return best, sizes


def headline(layers: int, stages: int, repeat: int) -> None:
    """The former unit test's case: plain weights from seed 3, checked as it checked them."""
    rng = random.Random(3)
    weights = [rng.random() for _ in range(layers)]
    seconds, sizes = best_of(repeat, lambda: balance(weights, stages))
    if len(sizes) != stages or sum(sizes) != layers or min(sizes) < 1:
        raise SystemExit(f"balance returned an invalid cut: {sizes}")
    starts = [sum(sizes[:stage]) for stage in range(stages)]
    slowest = max(sum(weights[start:start + size]) for start, size in zip(starts, sizes))
    print(f"{layers} plain weights into {stages} stages: {seconds:.3f} s (best of {repeat}; "
          f"slowest stage {slowest:.4g}, {slowest / (sum(weights) / stages):.4f} x the mean)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=20_000)
    parser.add_argument("--stages", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    weights = [rng.random() for _ in range(args.layers)]
    costs = [
        LayerCost(
            forward=rng.uniform(1e-4, 1e-3),
            backward=rng.uniform(2e-4, 2e-3),
            param_bytes=rng.randint(10**5, 10**6),
            activation_bytes=rng.randint(10**5, 10**6),
            saved_bytes=rng.randint(10**5, 10**6),
        )
        for _ in range(args.layers)
    ]
    plain = balance(costs, args.stages)
    held = held_microbatches("1f1b", args.stages, args.stages)
    # A cap 10% under what the time-optimal cut needs, so that memory decides.
    limit = 0.9 * max(stage_memory(costs, plain, held))

    variants: list[tuple[str, Callable[[], list[int]]]] = [
        ("by time, plain weights", lambda: balance(weights, args.stages)),
        ("by time, LayerCost", lambda: balance(costs, args.stages)),
        ("by time, bandwidth 1 GB/s", lambda: balance(costs, args.stages, bandwidth=1e9)),
        ("by time, memory-capped (1f1b)", lambda: balance(costs, args.stages, memory_limit=limit)),
        ("by time, capped + bandwidth", lambda: balance(costs, args.stages, memory_limit=limit,
                                                        bandwidth=1e9)),
        ("by params", lambda: balance(costs, args.stages, by="params")),
    ]
    headline(args.layers, args.stages, args.repeat)
    print(f"balance of {args.layers} layers into {args.stages} stages (best of {args.repeat}):")
    for name, run in variants:
        seconds, sizes = best_of(args.repeat, run)
        print(f"  {name:<32} {seconds:8.3f} s   largest stage {max(sizes)} layers")


if __name__ == "__main__":
    main()
