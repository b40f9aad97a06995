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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--stages", nargs="+", default=["gpt", "linear"], choices=["gpt", "linear"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
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
