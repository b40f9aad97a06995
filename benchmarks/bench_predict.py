"""Predicted step (``Pipe.predict``) against the measured one, every schedule, on 2 gloo ranks.

Run from the repository root (the full grid takes a few minutes; ``--quick`` under one):

    python benchmarks/bench_predict.py
    python benchmarks/bench_predict.py --quick
    python benchmarks/bench_predict.py --models mlp --schedules 1f1b zb-h1 --microbatches 8

For every schedule of ``schedules.schedule_names()`` x 3 models (an MLP, a small
GPT, a CNN) x M in {4, 8, 16}, one Pipe per cell on 2 gloo ranks (one thread per
rank, ``checkpoint="except_last"``):

- ``before``: ``pipeline.predict.step.predict_step`` before the Pipe's first step: chunk
  costs measured by the probes, hops from the ping-pong at construction;
- ``refined``: the same after the warm-up steps, refined from their measured
  timelines: hop latency from the delays waiting stages saw, each stage's compute
  from its median busy time (what ``Pipe.predict`` does after steps);
- measured: the median makespan of ``--steps`` steps after ``--warmup``, and the
  bubble of the median-makespan step; peak activation bytes, the largest stage's
  ``pipe.memory`` peak against the prediction's ``peak_activation_bytes``.

The bar: |predicted - measured| <= 10% of measured, for the makespan and for peak
activation memory, in every cell. Where a cell misses it, a line says what the
model misses: per stage, the compute it predicted against what the step's actions
took, and the idle time (waiting for hops) predicted against measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _spawn import LoadMonitor, run_ranks  # noqa: E402

MODELS = ("mlp", "gpt", "cnn")
COUNTS = (4, 8, 16)
BAR = 0.10


# -- the models (built the same on every rank) ------------------------------------------------


def build(name: str) -> tuple[Any, Any, Any, Any]:
    """(model, x, target, loss_fn) of one of MODELS, the same on every rank."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    if name == "mlp":
        from examples.models import uneven_mlp

        x = torch.randn(128, 256, generator=generator)
        return uneven_mlp(256), x, torch.randint(0, 10, (128,), generator=generator), \
            nn.CrossEntropyLoss()
    if name == "gpt":
        from examples.gpt import gpt, lm_loss

        tokens = torch.randint(0, 96, (64, 33), generator=generator)
        model = gpt(96, dim=64, layers=6, heads=4, seq=32, drop_path=0.1, dropout=0.1)
        return model, tokens[:, :-1].clone(), tokens[:, 1:].clone(), lm_loss()
    if name == "cnn":
        x = torch.randn(64, 3, 16, 16, generator=generator)
        return small_cnn(), x, torch.randint(0, 10, (64,), generator=generator), \
            nn.CrossEntropyLoss()
    raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")


def small_cnn() -> Any:
    """Conv-BN-ReLU blocks, a pool and a linear head: 8 layers, 3x16x16 images in."""
    from torch import nn

    def block(inputs: int, outputs: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(inputs, outputs, 3, padding=1), nn.BatchNorm2d(outputs),
                             nn.ReLU())

    return nn.Sequential(block(3, 16), block(16, 16), nn.MaxPool2d(2), block(16, 32),
                         block(32, 32), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


# -- one rank --------------------------------------------------------------------------------


def rank_main(rank: int, world: int, cells: list[tuple[str, str, int]], warmup: int,
              steps: int) -> list[dict[str, Any]]:
    """Per cell: both predictions and the measured timelines (rank 0), memory (every rank)."""
    import torch.distributed as dist

    from pipeline import Pipe, keep_freed_pages
    from pipeline.compute.microbatch import split_batch
    from pipeline.predict.step import predict_step

    keep_freed_pages()  # host memory kept between actions, as a GPU's caching allocator keeps it
    results = []
    for model_name, schedule, microbatches in cells:
        model, x, target, loss_fn = build(model_name)
        pipe = Pipe(model, chunks=microbatches, schedule=schedule, loss_fn=loss_fn,
                    group=dist.group.WORLD)
        placement = pipe.schedule.placement
        mine_x = x if placement[0] == rank else None
        mine_y = target if placement[-1] == rank else None
        inputs, targets = split_batch(mine_x, mine_y, microbatches, in_process=False)
        with pipe.measure_memory():  # the whole run measured, as predicted: with the hooks
            speed_before = reference_seconds()
            before = predict_step(pipe._runner, inputs, targets, ranks=pipe.ranks)
            warm = []
            for _ in range(warmup):
                pipe.zero_grad()
                pipe.step(mine_x, mine_y)
                warm.append(pipe.timeline)
            after = predict_step(pipe._runner, inputs, targets, ranks=pipe.ranks,
                                 measured=tuple(warm) if rank == 0 else None)
            timelines, memory, speed = [], [], []
            for _ in range(steps):
                speed.append(reference_seconds())
                dist.barrier()
                pipe.zero_grad()
                pipe.step(mine_x, mine_y)
                timelines.append(pipe.timeline)
                memory.append(pipe.memory[0].peak_bytes)
        pipe.close()
        results.append({
            "cell": (model_name, schedule, microbatches), "stage": rank,
            "memory": statistics.median(memory),
            "before": before if rank == 0 else None, "after": after if rank == 0 else None,
            "timelines": timelines if rank == 0 else None,
            "drift": statistics.median(speed) / speed_before,
        })
    return results


def reference_seconds() -> float:
    """Median seconds of a fixed piece of work (matrix products and Python calls): the
    machine's speed of the moment, to tell a VM slowing down from a model that is wrong."""
    import torch

    a = torch.ones(192, 192)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(10):
            a = torch.tanh(a @ a / 192.0)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- the table -------------------------------------------------------------------------------


def _error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else 0.0


def misses(predicted: Any, measured: Any) -> str:
    """Per stage: predicted vs measured compute (busy) and idle, in ms."""
    parts = []
    for stage in range(measured.stages):
        parts.append(f"s{stage} busy {1e3 * predicted.busy[stage]:.2f}/"
                     f"{1e3 * measured.busy[stage]:.2f} idle {1e3 * predicted.idle[stage]:.2f}/"
                     f"{1e3 * measured.idle[stage]:.2f}")
    return "; ".join(parts) + " (predicted/measured ms)"


def report(by_cell: dict[tuple[str, str, int], list[dict[str, Any]]]) -> list[tuple[Any, ...]]:
    rows = []
    header = (f"{'model':<5} {'schedule':<17} {'M':>3} | {'measured':>8} {'before':>8} {'err':>6} "
              f"{'refined':>8} {'err':>6} | {'bubble':>6} {'before':>6} {'refined':>7} | "
              f"{'act. KiB':>8} {'pred.':>8} {'err':>6} | {'drift':>5} contention")
    print(header)
    print("-" * len(header))
    for cell, entries in by_cell.items():
        first = next(e for e in entries if e["stage"] == 0)
        before, after = first["before"], first["after"]
        timelines = sorted(first["timelines"], key=lambda t: t.makespan)
        median = timelines[len(timelines) // 2]
        measured = statistics.median(t.makespan for t in timelines)
        measured_memory = max(e["memory"] for e in entries)
        predicted_memory = max(after.peak_activation_bytes)
        drift = max(e["drift"] for e in entries)
        row = (cell, measured, before.timeline.makespan, after.timeline.makespan,
               median.bubble_fraction, before.timeline.bubble_fraction,
               after.timeline.bubble_fraction, measured_memory, predicted_memory, median,
               after.timeline, drift, before.contention)
        rows.append(row)
        print(f"{cell[0]:<5} {cell[1]:<17} {cell[2]:>3} | {1e3 * measured:8.2f} "
              f"{1e3 * row[2]:8.2f} {_error(row[2], measured):+6.1%} {1e3 * row[3]:8.2f} "
              f"{_error(row[3], measured):+6.1%} | {row[4]:6.3f} {row[5]:6.3f} {row[6]:7.3f} | "
              f"{measured_memory / 1024:8.1f} {predicted_memory / 1024:8.1f} "
              f"{_error(predicted_memory, measured_memory):+6.1%} | {drift:5.2f} "
              f"{' '.join(f'{f:.2f}' for f in before.contention)}")
    return rows


def summary(rows: list[tuple[Any, ...]]) -> None:
    for label, index in (("before", 2), ("refined", 3)):
        errors = [abs(_error(r[index], r[1])) for r in rows]
        worst = max(range(len(rows)), key=lambda i: errors[i])
        within = sum(e <= BAR for e in errors)
        print(f"makespan {label:>7}: {within}/{len(rows)} cells within {BAR:.0%}, median "
              f"|err| {statistics.median(errors):.1%}, worst {_error(rows[worst][index], rows[worst][1]):+.1%} at "
              f"{rows[worst][0]}")
    steady = [abs(_error(r[2] * r[11], r[1])) for r in rows]
    print(f"makespan before x drift: {sum(e <= BAR for e in steady)}/{len(rows)} cells within "
          f"{BAR:.0%}, median |err| {statistics.median(steady):.1%} (the machine's change of "
          f"speed between prediction and measurement taken out)")
    memory = [abs(_error(r[8], r[7])) for r in rows]
    worst = max(range(len(rows)), key=lambda i: memory[i])
    print(f"peak activation memory: {sum(e <= BAR for e in memory)}/{len(rows)} cells within "
          f"{BAR:.0%}, worst {_error(rows[worst][8], rows[worst][7]):+.1%} at {rows[worst][0]}")
    failing = [r for r in rows if abs(_error(r[3], r[1])) > BAR]
    if failing:
        print(f"\nwhat the model misses where the refined makespan is off by more than "
              f"{BAR:.0%}:")
        for row in failing:
            print(f"  {row[0]}: {misses(row[10], row[9])}")


def main(argv: list[str] | None = None) -> int:
    from schedules import schedule_names

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a subset: 1f1b, zb-h1, interleaved-1f1b, zb-v on the MLP and GPT, M=8")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--schedules", nargs="+", default=list(schedule_names()))
    parser.add_argument("--microbatches", nargs="+", type=int, default=list(COUNTS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.microbatches = ["mlp", "gpt"], [8]
        args.schedules = ["1f1b", "zb-h1", "interleaved-1f1b", "zb-v"]
    cells = [(m, s, n) for m in args.models for s in args.schedules for n in args.microbatches]
    started = time.perf_counter()
    with LoadMonitor() as monitor:
        answers = run_ranks(rank_main, 2, cells, args.warmup, args.steps, timeout=1200.0)
    by_cell: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for entries in answers:
        for entry in entries:
            by_cell.setdefault(entry["cell"], []).append(entry)
    print(f"2 gloo ranks, one thread each, checkpoint='except_last'; ms; measured = median of "
          f"{args.steps} steps after {args.warmup} warm-up; before = predicted before any step, "
          f"refined = from the warm-up steps' timelines; act. = peak activation bytes of "
          f"the busiest stage (pipe.memory) vs predicted; drift = a fixed reference "
          f"workload's time during the measured steps over its time before the prediction "
          f"(> 1: the machine slowed down); contention = per stage, predict()'s factor")
    rows = report(by_cell)
    print()
    summary(rows)
    print(f"\nother processes kept {monitor.mean():.2f} cores busy on average; "
          f"{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
