"""A traced model against the same model written by hand as an nn.Sequential: what tracing costs.

Run from the repository root:

    python benchmarks/bench_any_model.py                  # GPT-2 (128 wide, 4 blocks), 2 stages
    python benchmarks/bench_any_model.py --steps 30 --schedule zb-h1

Both pipelines run the same Hugging Face ``GPT2LMHeadModel`` (the same module objects) on
the same batch of token ids, with the same cut (prologue | 2 blocks | 2 blocks | epilogue
as 3 + 3 units) and schedule, in one process (two CPU stages, one thread each):

- ``traced``: ``Pipe(model, sample=batch)``, the model as it is written, cut into units;
- ``by hand``: ``nn.Sequential(embeddings, *model.transformer.h, final norm and head)``,
  what a user had to write before.

Figures: the median step time over ``--steps`` rounds (each round runs both, alternating
which goes first, so a change in the machine's load hits them alike) and their ratio; the
peak activation bytes each stage held (``pipe.measure_memory()``, one step, a separate Pipe)
and their ratio; and the trace time (``units.cut_model`` on a model not traced before:
two ``torch.export`` runs, training and evaluation).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipeline import Pipe, keep_freed_pages


class Embeddings(nn.Module):
    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(positions))


class Block(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        output = self.block(hidden)
        return output[0] if isinstance(output, tuple) else output


class Head(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def build(width: int, layers: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_embd=width, n_layer=layers, n_head=4, n_positions=256,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                        eos_token_id=2)
    return GPT2LMHeadModel(config)


def by_hand(model: nn.Module) -> nn.Sequential:
    return nn.Sequential(Embeddings(model.transformer), *[Block(b) for b in model.transformer.h],
                         Head(model))


def traced_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), labels.flatten())


def plain_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def pipes(model: nn.Module, batch: dict[str, torch.Tensor], options: dict[str, Any],
          ) -> dict[str, Pipe]:
    balance = [1 + len(model.transformer.h) // 2, len(model.transformer.h) - len(
        model.transformer.h) // 2 + 1]
    common = dict(balance=balance, devices=["cpu", "cpu"], **options)
    return {"traced": Pipe(model, loss_fn=traced_loss, sample=batch, **common),
            "by hand": Pipe(by_hand(model), loss_fn=plain_loss, **common)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    keep_freed_pages()  # host memory kept between actions, as a GPU's caching allocator keeps it
    torch.set_num_threads(1)
    from units import cut_model

    model = build(args.width, args.layers)
    ids = torch.randint(0, 512, (args.rows, args.length))
    labels = torch.randint(0, 512, (args.rows, args.length))
    batch = {"input_ids": ids}
    started = time.perf_counter()
    cut_model(model, batch)
    trace_seconds = time.perf_counter() - started
    options = dict(chunks=args.chunks, schedule=args.schedule, checkpoint="never")
    inputs = {"traced": batch, "by hand": ids}
    runners = pipes(model, batch, options)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for step in range(args.steps + 2):
        order = list(runners) if step % 2 == 0 else list(reversed(runners))
        for name in order:
            begun = time.perf_counter()
            runners[name].step(inputs[name], labels)
            if step >= 2:  # two warm-up rounds
                times[name].append(time.perf_counter() - begun)
            model.zero_grad()
    for pipe in runners.values():
        pipe.close()
    peaks = {}
    for name, pipe in pipes(model, batch, options).items():
        with pipe.measure_memory():
            pipe.step(inputs[name], labels)
        peaks[name] = [report.peak_bytes for report in pipe.memory]
        pipe.close()
        model.zero_grad()
    medians = {name: statistics.median(found) for name, found in times.items()}
    print(f"GPT-2 {args.width} wide, {args.layers} blocks, batch {args.rows} x {args.length}, "
          f"{args.schedule}, M = {args.chunks}, 2 stages, one process")
    for name in runners:
        print(f"  {name:8s} step {1e3 * medians[name]:8.2f} ms   peak activation bytes per "
              f"stage {peaks[name]}")
    print(f"  traced / by hand: step time {medians['traced'] / medians['by hand']:.3f}, "
          f"peak activation bytes " + ", ".join(
              f"{a / b:.3f}" for a, b in zip(peaks["traced"], peaks["by hand"])))
    print(f"  trace time (two torch.export runs, once per model make): {trace_seconds:.2f} s")


if __name__ == "__main__":
    main()
