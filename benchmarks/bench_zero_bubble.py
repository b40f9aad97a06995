"""The zero-bubble schedules on a GPT over 2 gloo ranks: ours against our 1F1B and against torch's.

Run from the repository root (2 ranks, one thread each; two to four minutes):

    python benchmarks/bench_zero_bubble.py
    python benchmarks/bench_zero_bubble.py --launches 5 --sides "ours zb-h1" "torch zb"

The model is the GPT stage of issue 22, four times: 4 pre-LayerNorm blocks (width
128, ``nn.MultiheadAttention`` with 4 heads, MLP 128 -> 512 -> 128, residuals) on
32 x 64 tokens, M=8 micro-batches, mean-squared error against a target. Ours:
``Pipe`` with 1F1B, ZB-H1 and ZB-V (``checkpoint="never"``), two blocks a rank (one
a chunk under ZB-V). torch.distributed.pipelining on the same blocks per rank:
``Schedule1F1B``, ``ScheduleInterleavedZeroBubble`` (one stage a rank: its ZB-H1)
and ``ScheduleZBVZeroBubble`` (stages 0 and 3 on rank 0, 1 and 2 on rank 1). Each
side runs in fresh processes, the sides take turns launch after launch; a step is
timed barrier to end on each rank, the slowest rank's time counts, a launch gives
the median of its steps and a side the median of its launches. The bars: our ZB-H1
and ZB-V no slower than our 1F1B, and each no slower than torch's counterpart.
Gradients are checked: every side's squared gradient norm equals ours under 1F1B.
Exits 1 when a bar is missed, 2 when gradients disagree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from _spawn import LoadMonitor, run_ranks

WIDTH, HEADS, BLOCKS, ROWS, TOKENS, MICROBATCHES = 128, 4, 4, 32, 64, 8
SIDES = ("ours 1f1b", "ours zb-h1", "ours zb-v", "torch 1f1b", "torch zb", "torch zbv",
         "ours zb-h1 graph", "ours zb-v graph")  # graph: Pipe(split_backward="graph")
BARS = {"ours zb-h1": ("ours 1f1b", "torch zb"), "ours zb-v": ("ours 1f1b", "torch zbv"),
        "ours 1f1b": ("torch 1f1b",)}


def make_model() -> Any:
    """The GPT's blocks, as an ``nn.Sequential`` (seeded: every side builds the same)."""
    import torch
    from bench_split_backward import Block
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*[Block(WIDTH, HEADS) for _ in range(BLOCKS)])


def make_batch() -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(1)
    return (torch.randn(ROWS, TOKENS, WIDTH, generator=generator),
            torch.randn(ROWS, TOKENS, WIDTH, generator=generator))


class Ours:
    def __init__(self, rank: int, schedule: str, split: str = "auto") -> None:
        import torch.distributed as dist
        from torch import nn

        from pipeline import Pipe

        self.model = make_model()
        self.pipe = Pipe(self.model, chunks=MICROBATCHES, schedule=schedule, checkpoint="never",
                         loss_fn=nn.MSELoss(), group=dist.group.WORLD,
                         split_backward=split)  # type: ignore[arg-type]
        x, y = make_batch()
        self.x = x if rank == 0 else None
        self.y = y if self.pipe.schedule.placement[-1] == rank else None

    def step(self) -> None:
        self.pipe.zero_grad()
        self.pipe.step(self.x, self.y)

    def parameters(self) -> Any:
        return self.pipe.parameters()


class Torch:
    """torch.distributed.pipelining with this rank's stages of the same blocks."""

    def __init__(self, rank: int, kind: str) -> None:
        import torch
        from torch import nn
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleInterleavedZeroBubble,
            ScheduleZBVZeroBubble,
        )

        model = make_model()
        if kind == "zbv":  # V placement: rank 0 runs stages 0 and 3, rank 1 stages 1 and 2
            indices = (0, 3) if rank == 0 else (1, 2)
            stages = [PipelineStage(model[i], i, BLOCKS, torch.device("cpu")) for i in indices]
        else:
            half = model[2 * rank:2 * rank + 2]
            stages = [PipelineStage(half, rank, 2, torch.device("cpu"))]
        self.modules = [stage.submod for stage in stages]
        self.first = any(stage.is_first for stage in stages)
        self.last = any(stage.is_last for stage in stages)
        loss = nn.MSELoss()
        if kind == "1f1b":
            self.schedule: Any = Schedule1F1B(stages[0], MICROBATCHES, loss_fn=loss)
        elif kind == "zb":
            self.schedule = ScheduleInterleavedZeroBubble(stages, MICROBATCHES, loss_fn=loss)
        else:
            self.schedule = ScheduleZBVZeroBubble(stages, MICROBATCHES, loss_fn=loss)
        self.x, self.y = make_batch()

    def step(self) -> None:
        for module in self.modules:
            module.zero_grad(set_to_none=True)
        args = (self.x,) if self.first else ()
        kwargs: dict[str, Any] = {"target": self.y, "losses": []} if self.last else {}
        self.schedule.step(*args, **kwargs)

    def parameters(self) -> Any:
        return [p for module in self.modules for p in module.parameters()]


def side_main(rank: int, world: int, side: str, warmup: int, steps: int) -> dict[str, Any]:
    """One side in fresh processes: each step's seconds on this rank, and the gradient norm."""
    import torch.distributed as dist

    from pipeline import keep_freed_pages

    keep_freed_pages()  # host memory kept between actions, both sides alike

    owner, schedule, *split = side.split()
    runner: Any = Ours(rank, schedule, *split) if owner == "ours" else Torch(rank, schedule)
    times = []
    for index in range(warmup + steps):
        dist.barrier()
        started = time.perf_counter()
        runner.step()
        if index >= warmup:
            times.append(time.perf_counter() - started)
    grad_sq = sum(float(p.grad.double().pow(2).sum()) for p in runner.parameters()
                  if p.grad is not None)
    return {"times": times, "grad_sq": grad_sq}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    args = parser.parse_args(argv)
    print(f"GPT: {BLOCKS} blocks (width {WIDTH}, MLP {4 * WIDTH}), {ROWS} x {TOKENS} tokens, "
          f"M={MICROBATCHES}, P=2 gloo ranks, 1 thread each; {args.launches} launches a side, "
          f"alternating; {args.steps} steps a launch after {args.warmup}")
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min average, {os.cpu_count()} cores)")
    launches: dict[str, list[float]] = {side: [] for side in args.sides}
    grads: dict[str, float] = {}
    with LoadMonitor() as monitor:
        for _ in range(args.launches):
            for side in args.sides:
                reports = run_ranks(side_main, 2, side, args.warmup, args.steps)
                steps = [max(r["times"][i] for r in reports) for i in range(args.steps)]
                launches[side].append(1e3 * statistics.median(steps))
                grads[side] = sum(r["grad_sq"] for r in reports)
    step = {side: statistics.median(values) for side, values in launches.items()}
    print(f"\n{'side':<12} {'step ms':>8}  launch medians")
    for side in args.sides:
        print(f"{side:<12} {step[side]:8.2f}  {' '.join(f'{v:.2f}' for v in launches[side])}")
    met = True
    print()
    for side, references in BARS.items():
        for reference in references:
            if side in step and reference in step:
                ratio = step[side] / step[reference]
                met &= ratio <= 1.0
                print(f"{side} / {reference}: {ratio:.3f} (bar <= 1)")
    reference = grads.get("ours 1f1b", next(iter(grads.values())))
    agree = all(abs(value - reference) <= 1e-4 * reference for value in grads.values())
    print(f"\ngradients agree (|g|^2 within 1e-4 of ours 1f1b): {'yes' if agree else 'NO'} "
          f"({', '.join(f'{k}: {v:.6g}' for k, v in grads.items())})")
    print(f"other processes kept {monitor.mean():.2f} cores busy on average; "
          f"load after: {os.getloadavg()[0]:.2f}")
    print(f"bars: {'MET' if met else 'MISSED'}")
    if not agree:
        return 2
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
