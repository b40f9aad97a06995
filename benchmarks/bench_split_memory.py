"""Pipe.predict's peak activation bytes against the measured ones under the zero-bubble schedules.

Run from the repository root (one process; about a minute):

    python benchmarks/bench_split_memory.py
    python benchmarks/bench_split_memory.py --checkpoint always --ranks 2

The GPT of ``bench_zero_bubble.py`` (4 pre-LayerNorm blocks of width 128, 32 x 64
tokens, M=8) in two stages, under ZB-H1 (two blocks a stage) and ZB-V (one a chunk), for
each path of the split backward: ``graph`` (the graph split keeps its captures and the
saved tensors W reads), ``layers`` (every Linear defers its weight gradient: W keeps its
records, input and output gradient) and ``auto``. Per stage: the prediction made before
any step (``Prediction.peak_activation_bytes``), the peak measured in the first step and
in the second (``pipe.measure_memory()``, then ``pipe.memory``), and predicted / measured
for both. Why two steps: a chunk switches its deferring layers on at its first I, so the
first step's micro-batch 0 keeps for W what the graph split keeps; the prediction is of
the steps after it. With ``--ranks 2`` each stage runs on its own gloo rank. The bar
(issue 33): predicted within 5% of the second step's measured peak on every stage.
Exits 1 when it is missed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_zero_bubble import MICROBATCHES, make_batch, make_model  # noqa: E402

SCHEDULES = ("zb-h1", "zb-v")
PATHS = ("graph", "layers", "auto")
WITHIN = 0.05


def measured_peaks(pipe: Any, x: Any, y: Any) -> list[int]:
    """This process's stages' peak activation bytes in one step (the one place that asks how)."""
    with pipe.measure_memory():
        pipe.step(x, y)
    return [report.peak_bytes for report in pipe.memory]


def cell(schedule: str, path: str, checkpoint: str, group: Any = None,
         rank: int = 0) -> dict[str, list[float]]:
    """Predicted, first and second measured peaks of this process's stages."""
    from torch import nn

    from pipeline import Pipe
    from pipeline.compute.microbatch import split_batch
    from pipeline.predict.step import predict_step

    model = make_model()
    layout: dict[str, Any] = ({"group": group} if group is not None
                              else {"devices": ["cpu", "cpu"]})
    balance = [2, 2] if schedule == "zb-h1" else [1, 1, 1, 1]
    with Pipe(model, chunks=MICROBATCHES, balance=balance, schedule=schedule,
              checkpoint=checkpoint, loss_fn=nn.MSELoss(),  # type: ignore[arg-type]
              split_backward=path, **layout) as pipe:
        x, y = make_batch()
        placement = pipe.schedule.placement
        if group is not None:
            x = x if placement[0] == rank else None
            y = y if placement[-1] == rank else None
        inputs, targets = split_batch(x, y, MICROBATCHES, in_process=group is None)
        prediction = predict_step(pipe._runner, inputs, targets, ranks=pipe.ranks)
        predicted = list(prediction.peak_activation_bytes)
        if group is not None:
            predicted = [predicted[rank]]
        first = measured_peaks(pipe, x, y)
        second = measured_peaks(pipe, x, y)
    return {"predicted": predicted, "first": first, "second": second}


def rank_main(rank: int, world: int, checkpoint: str) -> dict[tuple[str, str], Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    return {(s, p): cell(s, p, checkpoint, dist.group.WORLD, rank)
            for s in SCHEDULES for p in PATHS}


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="never",
                        choices=("never", "except_last", "always"))
    parser.add_argument("--ranks", type=int, default=1, choices=(1, 2),
                        help="2: each stage on its own gloo rank")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.ranks == 2:
        from _spawn import run_ranks

        reports = run_ranks(rank_main, 2, args.checkpoint)
        found = {key: {field: [v for r in reports for v in r[key][field]]
                       for field in ("predicted", "first", "second")} for key in reports[0]}
    else:
        found = {(s, p): cell(s, p, args.checkpoint) for s in SCHEDULES for p in PATHS}
    print(f"GPT of bench_zero_bubble, 2 stages, M={MICROBATCHES}, checkpoint="
          f"{args.checkpoint}, {'2 gloo ranks' if args.ranks == 2 else 'one process'}; "
          f"KiB per stage")
    print(f"{'schedule':8} {'path':7} {'predicted':>17} {'first step':>17} {'second step':>17} "
          f"{'pred/first':>13} {'pred/second':>13}")
    met = True
    for (schedule, path), figures in found.items():
        predicted, first, second = figures["predicted"], figures["first"], figures["second"]
        to_first = [p / m for p, m in zip(predicted, first)]
        to_second = [p / m for p, m in zip(predicted, second)]
        met &= all(abs(r - 1.0) <= WITHIN for r in to_second)

        def kib(values: list[float]) -> str:
            return " ".join(f"{v / 1024:8.1f}" for v in values)

        print(f"{schedule:8} {path:7} {kib(predicted):>17} {kib(first):>17} {kib(second):>17} "
              f"{' '.join(f'{r:6.4f}' for r in to_first):>13} "
              f"{' '.join(f'{r:6.4f}' for r in to_second):>13}")
    print(f"bar (predicted within {WITHIN:.0%} of the second step's, every stage): "
          f"{'MET' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
