"""How long each rank spends planning a ``save_checkpoint`` at 2, 4 and 8 gloo ranks.

Run from the repository root (one thread a rank; about a minute on two cores):

    python benchmarks/bench_checkpoint_planning.py
    python benchmarks/bench_checkpoint_planning.py --layers 64 --width 16 --saves 5

The same model at every size, cut finer as ranks grow: an ``nn.Sequential`` of
``--layers`` small Linear layers, one Pipe stage per rank (``layers / ranks`` layers
each), one training step with Adam so that every parameter has optimizer state, then
``--saves`` saves to the same directory (each replaces the last). A rank's planning
time is from the call to ``save_checkpoint`` to the moment DCP starts writing its
shards (``FileSystemWriter.write_data`` entered): preparing the directory, the local
plan, the exchange of plans, the global plan and this rank's final plan. The save time
is the whole call. Printed per size: the median over the saves of each rank's times,
the slowest rank's and rank 0's. The bar (issue 43): the slowest rank's planning at 8
ranks no more than 1.5x at 2 ranks (the model's entries are the same; a rank's own
shrink). Exits 1 when it is missed.

The writer's entry is timed by wrapping ``FileSystemWriter.write_data`` in the ranks
(the wrapper calls it unchanged), so that the same figure is taken from any version
of the library: ``PYTHONPATH=<an older checkout> python benchmarks/...`` times that one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from _spawn import run_ranks

SIZES = (2, 4, 8)
BAR = 1.5


def _rank_main(rank: int, world: int, layers: int, width: int, saves: int, folder: str
               ) -> dict[str, Any]:
    """One rank: a step, then ``saves`` saves; the planning and save seconds of each."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    import pipeline
    from pipeline import Pipe

    torch.set_num_threads(1)
    writing: list[float] = []
    original = FileSystemWriter.write_data

    def timed_write_data(self: Any, *args: Any, **kwargs: Any) -> Any:
        writing.append(time.perf_counter())
        return original(self, *args, **kwargs)

    FileSystemWriter.write_data = timed_write_data  # type: ignore[method-assign]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    pipe = Pipe(model, chunks=2, balance=[layers // world] * world, loss_fn=nn.MSELoss(),
                group=dist.group.WORLD)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    x, y = torch.randn(8, width), torch.randn(8, width)
    pipe.step(x if rank == 0 else None, y if rank == world - 1 else None)
    optimizer.step()
    planning, saving = [], []
    for step in range(saves):
        dist.barrier()
        writing.clear()
        started = time.perf_counter()
        pipeline.save_checkpoint(pipe, optimizer, os.path.join(folder, "checkpoint"), step=step)
        ended = time.perf_counter()
        planning.append(writing[0] - started)
        saving.append(ended - started)
    pipe.close()
    return {"planning": planning, "saving": saving, "library": pipeline.__file__}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--saves", type=int, default=5)
    args = parser.parse_args()
    rows = []
    library = ""
    for world in SIZES:
        with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as folder:
            reports = run_ranks(_rank_main, world, args.layers, args.width, args.saves, folder,
                                timeout=600.0)
        library = reports[0]["library"]
        planning = [statistics.median(report["planning"]) for report in reports]
        saving = [statistics.median(report["saving"]) for report in reports]
        rows.append((world, max(planning), planning[0], statistics.mean(planning),
                     max(saving), saving[0]))
    print(f"library: {os.path.dirname(library)}; {args.layers} Linear({args.width}, "
          f"{args.width}) layers, Adam, median of {args.saves} saves")
    print(f"{'ranks':>5} {'layers/rank':>11} {'plan slowest':>12} {'plan rank 0':>11} "
          f"{'plan mean':>9} {'save slowest':>12} {'save rank 0':>11}")
    for world, slowest, first, mean, save_slowest, save_first in rows:
        print(f"{world:>5} {args.layers // world:>11} {slowest * 1e3:>9.1f} ms "
              f"{first * 1e3:>8.1f} ms {mean * 1e3:>6.1f} ms {save_slowest * 1e3:>9.1f} ms "
              f"{save_first * 1e3:>8.1f} ms")
    ratio = rows[-1][1] / rows[0][1]
    met = ratio <= BAR
    print(f"slowest rank's planning, {SIZES[-1]} ranks / {SIZES[0]} ranks: {ratio:.2f} "
          f"(bar: at most {BAR}): {'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
