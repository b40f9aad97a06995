"""Tensor parallelism's collectives on a model as it is written, counted, against Megatron's formula.

Run from the repository root:

    python benchmarks/bench_tensor_parallel.py            # Llama, (pp=2, tp=2), 4 gloo ranks
    python benchmarks/bench_tensor_parallel.py --layers 8 --rows 8 --length 32 --hidden 64

A Hugging Face ``LlamaForCausalLM`` (random weights) runs one training step in a
``(pp=2, tp=2)`` mesh, split by the plan its config ships (``tensor_parallel="auto"``),
under 1F1B, then again with ``checkpoint="always"``. Each rank reads its boundaries'
counts (``pipe.tensor_parallel_counts``: all-reduces and bytes, forward and backward).

Megatron's formula, per transformer block and micro-batch, for activations of ``b`` rows,
``s`` tokens and width ``h`` in ``d`` bytes: 2 all-reduces of ``b*s*h*d`` bytes in the forward
(after the attention's and the MLP's row-split products) and 2 in the backward (before
their column-split products), and 2 more forward for a recomputed block. The table gives
both, per stage, and their ratio (1.00: exactly Megatron's).

Step time on a CPU-only host is not a figure here: the ranks share its cores.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch


def _rank(rank: int, world: int, layers: int, rows: int, length: int, hidden: int,
          chunks: int) -> list[dict[str, Any]]:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn import functional as F

    from pipeline import Distributed, Pipe, SummedLoss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2 * length, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base = transformers.LlamaForCausalLM(config).double()
    ids = torch.randint(3, 64, (rows, length), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                               reduction="sum")

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    found = []
    for mode in ("never", "always"):
        with Pipe(copy.deepcopy(base), chunks=chunks, checkpoint=mode, sample=batch,
                  loss_fn=SummedLoss(loss, lambda labels: labels[:, 1:].numel()),
                  distributed=Distributed.from_mesh(mesh, tensor_parallel="auto")) as pipe:
            pipe.step(batch, ids)
            counts = pipe.tensor_parallel_counts
            blocks = sum(1 for unit in pipe.units
                         if unit.stage == mesh.get_local_rank("pp") and ".layers." in
                         f".{unit.name}.")
            found.append({"mode": mode, "stage": mesh.get_local_rank("pp"), "blocks": blocks,
                          "forward": counts.forward, "backward": counts.backward,
                          "forward_bytes": counts.forward_bytes,
                          "backward_bytes": counts.backward_bytes})
    return found


def megatron(blocks: int, microbatches: int, rows: int, length: int, hidden: int,
             recomputed: bool) -> tuple[int, int, int, int]:
    """Megatron's all-reduces for ``blocks`` blocks and a step of ``microbatches``: (forward
    count, backward count, forward bytes, backward bytes), float64."""
    message = (rows // microbatches) * length * hidden * 8
    forward = 2 * blocks * microbatches * (2 if recomputed else 1)
    backward = 2 * blocks * microbatches
    return forward, backward, forward * message, backward * message


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args()
    from _spawn import run_ranks

    by_rank = run_ranks(_rank, 4, args.layers, args.rows, args.length, args.hidden,
                        args.chunks, timeout=900)
    print(f"Llama {args.layers} blocks, width {args.hidden}, batch {args.rows} x "
          f"{args.length} tokens in {args.chunks} micro-batches, (pp=2, tp=2), 1F1B, float64")
    print(f"{'checkpoint':>10} {'stage':>5} {'blocks':>6} | {'all-reduces fwd/bwd':>19} "
          f"{'Megatron':>9} | {'MiB fwd/bwd':>13} {'Megatron':>13} | ratio")
    for rank in (0, 2):  # tp rank 0 of each stage; its partner counts the same
        for row in by_rank[rank]:
            expected = megatron(row["blocks"], args.chunks, args.rows, args.length, args.hidden,
                                row["mode"] == "always")
            ours = (row["forward"], row["backward"], row["forward_bytes"],
                    row["backward_bytes"])
            ratio = (ours[0] + ours[1]) / max(1, expected[0] + expected[1])
            print(f"{row['mode']:>10} {row['stage']:>5} {row['blocks']:>6} | "
                  f"{ours[0]:>9}/{ours[1]:<9} {expected[0]:>4}/{expected[1]:<4} | "
                  f"{ours[2] / 2**20:>6.2f}/{ours[3] / 2**20:<6.2f} "
                  f"{expected[2] / 2**20:>6.2f}/{expected[3] / 2**20:<6.2f} | {ratio:.2f}")
    for rank, rows in enumerate(by_rank):
        partner = by_rank[rank ^ 1]
        assert [(r["forward"], r["backward"]) for r in rows] == \
            [(r["forward"], r["backward"]) for r in partner], "tp ranks counted apart"


if __name__ == "__main__":
    main()
