"""What checking a traced model for changes costs a step: the check against the step it guards.

Run from the repository root:

    python benchmarks/bench_trace_check.py                 # a 32-block Llama, 2 stages
    python benchmarks/bench_trace_check.py --layers 32 --hidden 128 --steps 10

Before every ``pipe.step`` and ``pipe(x)`` of a traced model, the Pipe compares the model
with what its graphs were traced from (``TracedCut.check_model``: every module's
attributes, instance forwards, hooks, modes and config). This prints that check's median
time over ``--checks`` calls, the median step time over ``--steps`` steps (one process, two
CPU stages, 1F1B, float32), and their ratio: the share of a step the check costs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F

from pipeline import Pipe, SummedLoss, keep_freed_pages


def _loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")


def _count(labels: torch.Tensor) -> torch.Tensor:
    return torch.tensor(labels[:, 1:].numel())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--checks", type=int, default=50)
    args = parser.parse_args()
    keep_freed_pages()  # host memory kept between actions, as a GPU's caching allocator keeps it
    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden,
                         intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.length)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (args.rows, args.length))
    batch = {"input_ids": ids}
    began = time.perf_counter()
    pipe = Pipe(model, chunks=4, sample=batch, devices=["cpu", "cpu"], schedule="1f1b",
                loss_fn=SummedLoss(_loss, _count))
    cut = pipe.cut
    print(f"{args.layers}-block Llama, hidden {args.hidden}, batch {args.rows}x{args.length}: "
          f"{sum(1 for _ in model.modules())} modules; traced and cut in "
          f"{time.perf_counter() - began:.1f} s")
    checks = []
    for _ in range(args.checks):
        began = time.perf_counter()
        cut.check_model()
        checks.append(time.perf_counter() - began)
    pipe.step(batch, ids)  # warm-up
    steps = []
    for _ in range(args.steps):
        began = time.perf_counter()
        pipe.step(batch, ids)
        steps.append(time.perf_counter() - began)
    model.zero_grad()
    check, step = statistics.median(checks), statistics.median(steps)
    print(f"check {check * 1e3:.2f} ms (median of {args.checks}), step {step * 1e3:.1f} ms "
          f"(median of {args.steps}): the check is {check / step:.2%} of a step")
    pipe.close()


if __name__ == "__main__":
    main()
