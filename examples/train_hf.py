"""Train a Hugging Face Llama as it is written: Pipe traces it and cuts it into units.

A tiny ``LlamaForCausalLM`` built from a config (random weights: nothing is downloaded)
learns to repeat the first half of each sequence; rows are right-padded, with an
``attention_mask`` and labels of -100 on the padding. The model is handed to ``Pipe``
unchanged, called as ``model(**batch)``; the script prints the cut it chose.

    python examples/train_hf.py --steps 30                        # one process, 2 stages
    torchrun --nproc-per-node 2 examples/train_hf.py --steps 30   # one stage per process
    torchrun --nproc-per-node 2 examples/train_hf.py --steps 2 --float64 --compare
    torchrun --nproc-per-node 8 examples/train_hf.py --mesh 2,2,2 --float64 --compare

``--mesh PP,DP,TP`` runs it in a device mesh: FSDP2 over the ``dp`` replicas (each on its
share of the batch's rows) and tensor parallelism over ``tp`` by the plan the config ships
(``tensor_parallel="auto"``: q, k, v, gate and up split by columns, o and down by rows).

``--compare`` checks the loss and every parameter's gradient, by the model's own names
(sharded ones gathered whole), against the plain model on the whole batch (float64:
equal to 1e-10).
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from pipeline import Pipe, SummedLoss

VOCAB = 32


def build_model(layers: int, dtype: torch.dtype) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).to(dtype)


def copy_task(rows: int, half: int, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Sequences whose second half repeats the first; every third row right-padded."""
    generator = torch.Generator().manual_seed(step)
    first = torch.randint(3, VOCAB, (rows, half), generator=generator)
    ids = torch.cat([first, first], dim=1)
    mask = torch.ones_like(ids)
    mask[::3, -2:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :half] = -100  # only the repeated half is predictable
    return {"input_ids": ids, "attention_mask": mask}, labels


def lm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy; ``token_count`` gives what it counts."""
    return F.cross_entropy(output.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                           ignore_index=-100, reduction="sum")


def token_count(labels: torch.Tensor) -> torch.Tensor:
    return (labels[:, 1:] != -100).sum()


def compare(pipe: Pipe, plain: nn.Module, batch: dict[str, torch.Tensor], labels: torch.Tensor,
            loss: torch.Tensor) -> tuple[float, float, int]:
    """(loss error, worst gradient error, parameters compared) against the plain model on
    the whole batch (a sharded gradient gathered whole: every rank of a stage calls it)."""
    plain.zero_grad()
    expected = lm_loss(plain(**batch), labels) / token_count(labels)
    expected.backward()
    held = {id(p) for p in pipe.parameters()}
    plain_grads = dict(plain.named_parameters(remove_duplicate=False))
    errors = [(whole(p.grad) - plain_grads[name].grad).abs().max().item()
              for name, p in pipe.source_model.named_parameters(remove_duplicate=False)
              if id(p) in held and p.grad is not None]
    return abs(loss.item() - expected.item()), max(errors), len(errors)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (an FSDP or tensor-parallel shard) gathered whole; a tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def layout(mesh_text: str | None, distributed: bool, rows: int
           ) -> tuple[dict[str, Any], slice]:
    """The Pipe's process layout (``group=``, ``distributed=`` from a (pp, dp, tp) mesh, or
    two CPU stages in one process) and this replica's rows of the batch."""
    if not distributed:
        return {"devices": ["cpu", "cpu"]}, slice(0, rows)
    if mesh_text is None:
        return {"group": dist.group.WORLD}, slice(0, rows)
    from torch.distributed.device_mesh import init_device_mesh

    from pipeline import Distributed

    pp, dp, tp = (int(part) for part in mesh_text.split(","))
    if pp * dp * tp != dist.get_world_size() or rows % dp:
        raise SystemExit(f"--mesh {mesh_text}: expected PP*DP*TP = {dist.get_world_size()} "
                         f"processes and --rows divisible by DP, got --rows {rows}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    share = rows // dp
    replica = mesh.get_local_rank("dp")
    options = Distributed.from_mesh(mesh, data_parallel="fsdp",
                                    tensor_parallel="auto" if tp > 1 else None)
    return {"distributed": options}, slice(replica * share, (replica + 1) * share)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--half", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--checkpoint", default="except_last")
    parser.add_argument("--float64", action="store_true")
    parser.add_argument("--mesh", default=None, metavar="PP,DP,TP",
                        help="a (pp, dp, tp) device mesh: FSDP over dp, tensor parallelism "
                             "over tp by the config's plan")
    parser.add_argument("--compare", action="store_true",
                        help="check loss and gradients against the plain model each step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    dtype = torch.float64 if args.float64 else torch.float32
    model = build_model(args.layers, dtype)
    plain = copy.deepcopy(model) if args.compare else None
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=3e-3) if plain else None
    where, mine = layout(args.mesh, distributed, args.rows)
    sample = {key: value[mine] for key, value in copy_task(args.rows, args.half, 0)[0].items()}
    with Pipe(model, chunks=args.chunks, schedule=args.schedule, checkpoint=args.checkpoint,
              loss_fn=SummedLoss(lm_loss, token_count), sample=sample, **where) as pipe:
        if rank == 0:
            print(f"cut into {len(pipe.units)} units, balance {pipe.balance}:")
            for unit in pipe.units:
                print(f"  {unit.index}: {unit.name} ({len(unit.parameters)} parameters)")
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
        for step in range(args.steps):
            batch, labels = copy_task(args.rows, args.half, step)
            loss = pipe.step({key: value[mine] for key, value in batch.items()}, labels[mine])
            if plain is not None:
                loss_error, grad_error, count = compare(pipe, plain, batch, labels, loss)
                print(f"rank {rank} step {step}: loss error {loss_error:.1e}, gradient error "
                      f"{grad_error:.1e} over {count} parameters")
                assert plain_optimizer is not None
                plain_optimizer.step()
            optimizer.step()
            optimizer.zero_grad()
            if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
                print(f"step {step}: loss {loss.item():.4f}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
