"""Time a single-process Pipe step against the same micro-batches run one after another.

Run from the repository root:

    python benchmarks/bench_pipe.py                       # P=2, M=8, 1F1B, ~100 ms step
    python benchmarks/bench_pipe.py --schedule gpipe --steps 20 --target-ms 200

Every stage is a thread with one intra-op thread (``torch.set_num_threads(1)``),
so P stages can use at most P cores. The model is an MLP of equal Linear+ReLU
blocks in float32, cut in two equal halves, deep enough that one unpipelined
step over the whole batch takes about ``--target-ms``.

Figures (milliseconds, medians over ``--steps`` rounds after ``--warmup``; each round
runs every variant once, so a change in the machine's load hits them alike):

- ``pipelined``: ``Pipe.step`` over M micro-batches on P stages.
- ``S(M)``: one thread running the same M micro-batches forward and backward one
  after another, accumulating gradients: the work the pipeline spreads out.
- ``ideal``: ``S(M) x (M+P-1) / (M x P)``, the GPipe/1F1B makespan with equal
  stages, backward = 2 x forward and free communication.
- ``ratio``: pipelined / ideal (1.0 is the ideal; above it, overheads).
- ``simulated``: ``simulate(schedule)`` fed with the per-stage means of the
  measured forward and backward actions: what the order alone predicts.
- ``machine check``: each stage's layers run S(M)'s work in P independent threads,
  nothing shared. On P idle cores it takes about S(M) / P; when it takes more, the
  machine (other load, shared cores) rather than the pipeline sets the limit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pipeline import Pipe, keep_freed_pages
from schedules import Op, Timeline, simulate

STAGES = 2


def block_model(width: int, blocks: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def best_seconds(run: Callable[[], object], steps: int, warmup: int) -> float:
    """The fastest of ``steps`` runs after ``warmup``: the least disturbed by other load."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def whole_batch_step(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()


def sequential_step(model: nn.Sequential, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> None:
    """S(M): the micro-batches one after another, gradients accumulated, losses weighted."""
    model.zero_grad(set_to_none=True)
    rows = sum(x.shape[0] for x in xs)
    for x, y in zip(xs, ys):
        (nn.functional.mse_loss(model(x), y) * (x.shape[0] / rows)).backward()


def independent_stages(parts: list[nn.Sequential], xs: list[torch.Tensor],
                       ys: list[torch.Tensor]) -> None:
    """Each stage's share of S(M) in its own thread, with nothing to wait for: what the
    machine gives P threads at best (about S(M) / P on P idle cores)."""
    threads = [threading.Thread(target=sequential_step, args=(part, xs, ys)) for part in parts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def calibrate(width: int, rows: int, target: float) -> int:
    """Blocks (a multiple of STAGES) for a whole-batch step of about ``target`` seconds."""
    x, y = torch.randn(rows, width), torch.randn(rows, width)
    blocks = STAGES
    for _ in range(3):  # a fixed point in a few rounds: time is about linear in depth
        model = block_model(width, blocks)
        per_block = best_seconds(lambda m=model: whole_batch_step(m, x, y), 5, 2) / blocks
        blocks = max(STAGES, STAGES * round(target / per_block / STAGES))
    return blocks


def action_means(timelines: list[Timeline]) -> tuple[list[float], list[float]]:
    """Per stage, the mean duration of its forward and of its backward actions."""
    durations: dict[tuple[int, Op], list[float]] = defaultdict(list)
    for timeline in timelines:
        for event in timeline.events:
            durations[(event.stage, event.action.op)].append(event.duration)
    stages = range(timelines[0].stages)
    forward = [statistics.mean(durations[(s, Op.F)]) for s in stages]
    backward = [statistics.mean(durations[(s, Op.B)]) for s in stages]
    return forward, backward


@dataclass
class Figures:
    """Median seconds of each way to run the step, and the measured timelines."""

    whole: float
    sequential: float
    pipelined: float
    independent: float
    timelines: list[Timeline]


def measure(args: argparse.Namespace, blocks: int) -> tuple[Pipe, Figures]:
    """Run the four ways in interleaved rounds, so a change of load hits them alike."""
    stages, microbatches = STAGES, args.microbatches
    model = block_model(args.width, blocks)
    x, y = torch.randn(args.rows, args.width), torch.randn(args.rows, args.width)
    xs, ys = list(x.tensor_split(microbatches)), list(y.tensor_split(microbatches))
    pipe = Pipe(model, microbatches, balance=[2 * blocks // stages] * stages,
                devices=["cpu"] * stages, schedule=args.schedule, checkpoint=args.checkpoint,
                loss_fn=nn.MSELoss())
    parts = [block_model(args.width, blocks // stages) for _ in range(stages)]
    timelines: list[Timeline] = []

    def pipelined_step() -> None:
        pipe.zero_grad()
        pipe.step(x, y)
        assert pipe.timeline is not None
        timelines.append(pipe.timeline)

    runs: dict[str, Callable[[], object]] = {
        "whole": lambda: whole_batch_step(model, x, y),
        "sequential": lambda: sequential_step(model, xs, ys),
        "pipelined": pipelined_step,
        "independent": lambda: independent_stages(parts, xs, ys),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.warmup + args.steps):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            if round_ >= args.warmup:
                times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return pipe, Figures(**medians, timelines=timelines[args.warmup:])


def report(args: argparse.Namespace, blocks: int, pipe: Pipe, figures: Figures,
           load: float) -> None:
    stages, microbatches = STAGES, args.microbatches
    forward, backward = action_means(figures.timelines)
    predicted = simulate(pipe.schedule, forward=forward, backward=backward)
    sequential, pipelined = figures.sequential, figures.pipelined
    ideal = sequential * (microbatches + stages - 1) / (microbatches * stages)
    bubble = statistics.median(t.bubble_fraction for t in figures.timelines)
    print(f"Pipe on CPU: P={stages} stages x 1 thread, M={microbatches}, {args.schedule}, "
          f"checkpoint={args.checkpoint}; MLP of {blocks} Linear+ReLU blocks {args.width} "
          f"wide ({blocks // stages} per stage), float32, batch {args.rows}; torch "
          f"{torch.__version__}; medians of {args.steps} rounds after {args.warmup}; "
          f"{os.cpu_count()} CPUs, load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    rows = [
        ("unpipelined step, whole batch", figures.whole, ""),
        ("S(M): M micro-batches in sequence", sequential, ""),
        ("ideal S(M) (M+P-1)/(M P)", ideal, ""),
        ("pipelined Pipe.step", pipelined, f"ratio pipelined/ideal {pipelined / ideal:.3f}"),
        ("simulated from measured action means", predicted.makespan,
         f"ratio pipelined/simulated {pipelined / predicted.makespan:.3f}"),
        (f"machine check: {stages} independent threads", figures.independent,
         f"each one stage's share of S(M); {stages} free cores: ~S(M)/{stages} = "
         f"{sequential / stages * 1000:.1f} ms"),
    ]
    for label, seconds, note in rows:
        print(f"  {label:<38} {seconds * 1000:8.1f} ms  {note}")
    print(f"  per-action means (ms): forward {[round(f * 1000, 2) for f in forward]}, "
          f"backward {[round(b * 1000, 2) for b in backward]}")
    attainable = figures.independent * (microbatches + stages - 1) / microbatches
    print(f"  attainable on this machine now: machine check x (M+P-1)/M = "
          f"{attainable * 1000:.1f} ms; pipelined / attainable {pipelined / attainable:.3f}")
    print(f"  speed-up over S(M): {sequential / pipelined:.2f}x (ideal "
          f"{sequential / ideal:.2f}x); measured bubble {bubble:.1%}, simulated "
          f"{predicted.bubble_fraction:.1%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    parser.add_argument("--checkpoint", default="never",
                        choices=["always", "except_last", "never"])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=256, help="batch size")
    parser.add_argument("--target-ms", type=float, default=100.0)
    parser.add_argument("--blocks", type=int, default=None,
                        help="Linear+ReLU blocks (a multiple of 2); default: calibrated")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    keep_freed_pages()  # host memory kept between actions, as a GPU's caching allocator keeps it
    if args.blocks is not None and (args.blocks < STAGES or args.blocks % STAGES):
        parser.error(f"--blocks must be a positive multiple of {STAGES}, got {args.blocks}")

    torch.set_num_threads(1)  # one intra-op thread per stage
    torch.manual_seed(0)
    load = os.getloadavg()[0]
    blocks = args.blocks or calibrate(args.width, args.rows, args.target_ms / 1000)
    pipe, figures = measure(args, blocks)
    report(args, blocks, pipe, figures, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
