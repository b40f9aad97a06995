"""The first stage's split backward: how much of B its I and its W each do (issue 33 item 4).

Run from the repository root (one process, one thread; about half a minute):

    python benchmarks/bench_first_stage_split.py
    python benchmarks/bench_first_stage_split.py --repeat 40 --stages gpt

A first stage's input needs no gradient, so the graph split has no input chain to
follow: before issue 33 item 4 its I was empty and its W the whole backward. Two
first stages, each fed one micro-batch that needs no gradient: (a) ``gpt``, a token
and position embedding then two pre-LayerNorm blocks (``bench_split_backward``'s)
on 4 x 64 tokens; (b) ``linear``, 8 x Linear(16) on 64 rows. Each round runs, in
turn, a forward then B, and for each path (``graph``, ``layers``, ``auto``, a
``ChunkSplit`` switched on, as a Pipe keeps one per chunk) a forward then its I
and W with no input to differentiate. Printed: medians of I/B, W/B and (I+W)/B.

With ``--pipe`` it instead runs bench_split_backward's Pipe (4 such blocks,
``balance=[2, 2]``, 4 micro-batches of 4 x 64 tokens) under 1F1B and ZB-H1 and prints,
per path, stage 0's median B (1F1B), I and W (ZB-H1) from ``pipe.timeline``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench_split_backward import Block  # noqa: E402
from pipeline import keep_freed_pages  # noqa: E402
from split_backward import ChunkSplit  # noqa: E402

PATHS = ("graph", "layers", "auto")


class Embedding(nn.Module):
    """Token and learned position embeddings, summed (GPT-2's first layer)."""

    def __init__(self, vocab: int = 1000, length: int = 64, dim: int = 128) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(length, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))


def make_stage(name: str) -> tuple[nn.Module, torch.Tensor]:
    """A first stage's layers and one micro-batch of its input (which needs no gradient)."""
    torch.manual_seed(0)
    if name == "gpt":
        return nn.Sequential(Embedding(), Block(), Block()), torch.randint(0, 1000, (4, 64))
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)]), torch.randn(64, 16)


def one_round(model: nn.Module, x: torch.Tensor, first: int,
              splits: dict[str, ChunkSplit]) -> dict[str, float]:
    """Seconds of B, and of I and W on each path, each after a fresh forward."""
    times: dict[str, float] = {}

    def plain() -> None:
        out = model(x)
        start = time.perf_counter()
        out.backward(torch.ones_like(out))
        times["B"] = time.perf_counter() - start

    def ours(path: str) -> None:
        split = splits[path]
        with split.forwarding(0):
            out = model(x)
        start = time.perf_counter()
        _, weights = split.backward_input([out], [torch.ones_like(out)], [], 0)
        middle = time.perf_counter()
        weights.run()
        times[f"{path} I"], times[f"{path} W"] = middle - start, time.perf_counter() - middle

    runs = [plain, *(lambda path=path: ours(path) for path in PATHS)]
    first %= len(runs)
    for run in runs[first:] + runs[:first]:
        run()
        model.zero_grad(set_to_none=True)
    return times


def pipe_table(steps: int) -> None:
    """Stage 0's B under 1F1B and I, W under ZB-H1, per path, from the Pipe's timelines."""
    from pipeline import Pipe
    from schedules import Op

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)])
    x, y = torch.randn(16, 64, 128), torch.randn(16, 64, 128)
    runs = [("1f1b", "auto", (Op.B,))] + [("zb-h1", path, (Op.I, Op.W)) for path in PATHS]
    durations: dict[tuple[str, Op], list[float]] = {}
    for schedule, path, ops in runs:
        pipe = Pipe(model, chunks=4, balance=[2, 2], devices=["cpu", "cpu"], schedule=schedule,
                    checkpoint="never", loss_fn=nn.MSELoss(), split_backward=path)
        for step in range(steps + 1):
            pipe.step(x, y)
            model.zero_grad(set_to_none=True)
            if step == 0:
                continue  # warm-up: the layers switch on at the first I
            for event in pipe.timeline.events:
                if event.stage == 0 and event.action.op in ops:
                    durations.setdefault((path, event.action.op), []).append(event.duration)
        pipe.close()
    b = statistics.median(durations[("auto", Op.B)])
    print(f"stage 0, B (1f1b) {b * 1e3:.1f} ms")
    print(f"{'path':7} {'I ms':>7} {'W ms':>7} {'I/B':>6} {'W/B':>6} {'(I+W)/B':>8}")
    for path in PATHS:
        i, w = (statistics.median(durations[(path, op)]) for op in (Op.I, Op.W))
        print(f"{path:7} {i * 1e3:7.1f} {w * 1e3:7.1f} {i / b:6.2f} {w / b:6.2f} {(i + w) / b:8.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--stages", nargs="+", default=["gpt", "linear"], choices=["gpt", "linear"])
    parser.add_argument("--pipe", action="store_true", help="stage 0 of a Pipe instead")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_pages()  # host memory kept between actions, as a GPU's caching allocator keeps it
    if args.pipe:
        pipe_table(steps=4)
        return 0
    print(f"{'stage':7} {'path':7} {'B ms':>8} {'I/B':>6} {'W/B':>6} {'(I+W)/B':>8}")
    for name in args.stages:
        model, x = make_stage(name)
        splits = {path: ChunkSplit(model, path) for path in PATHS}
        for split in splits.values():
            split.install()
        rounds = [one_round(model, x, index, splits) for index in range(3 + args.repeat)][3:]
        t = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        for path in PATHS:
            i, w = t[f"{path} I"] / t["B"], t[f"{path} W"] / t["B"]
            print(f"{name:7} {path:7} {t['B'] * 1e3:8.3f} {i:6.2f} {w:6.2f} {i + w:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
