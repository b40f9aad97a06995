"""Train a Hugging Face mixture of experts as it is written, its experts spread over ranks.

A tiny ``MixtralForCausalLM`` (or ``Qwen3MoeForCausalLM``, ``Qwen2MoeForCausalLM`` with its
shared expert) built from a config (random weights: nothing is downloaded) learns the copy
task of ``train_hf.py``. In a (pp, ep) mesh the ``ep`` ranks each take their own rows of
the batch and hold 1/ep of every layer's experts, by the plan the config ships
(``expert_parallel="auto"``: ``base_model_ep_plan``); each token goes by all-to-all to
the rank holding its expert and comes back weighted.

    torchrun --nproc-per-node 4 examples/train_moe.py --steps 20               # pp=2, ep=2
    torchrun --nproc-per-node 4 examples/train_moe.py --steps 2 --compare
    torchrun --nproc-per-node 4 examples/train_moe.py --model qwen2-moe --schedule zb-v
    torchrun --nproc-per-node 4 examples/train_moe.py --float64 --compare --steps 2
    torchrun --nproc-per-node 4 examples/train_moe.py --schedule dualpipe-v --overlap --compare

``--overlap`` runs DualPipeV's steady state as overlapped F&B pairs: each one's token
exchanges run while the other computes (``schedules.pairs``).

``--compare`` checks the loss and every parameter's gradient, by the model's own names
(experts gathered whole), against the plain model on the whole batch: float32 within
1e-5 relative, float64 (the experts' eager kernel) to 1e-10.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
from torch import nn

from pipeline import Distributed, Pipe, SummedLoss
from train_hf import VOCAB, compare, copy_task, lm_loss, token_count


def build_model(kind: str, layers: int, dtype: torch.dtype) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=128,
                                            num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
    elif kind == "qwen3-moe":
        config = transformers.Qwen3MoeConfig(**common, intermediate_size=128,
                                             moe_intermediate_size=64, num_experts=4,
                                             num_experts_per_tok=2)
        model = transformers.Qwen3MoeForCausalLM(config)
    elif kind == "qwen2-moe":
        config = transformers.Qwen2MoeConfig(**common, intermediate_size=128,
                                             moe_intermediate_size=64,
                                             shared_expert_intermediate_size=128,
                                             num_experts=4, num_experts_per_tok=2)
        model = transformers.Qwen2MoeForCausalLM(config)
    else:
        raise SystemExit(f"--model {kind}: expected mixtral, qwen3-moe or qwen2-moe")
    if dtype == torch.float64:  # the grouped expert kernel refuses float64; the loop takes it
        model.config._experts_implementation = "eager"
    return model.to(dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mixtral")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--half", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--checkpoint", default="never")
    parser.add_argument("--overlap", action="store_true",
                        help="the schedule's overlapped F&B pairs (dualpipe-v)")
    parser.add_argument("--ep", type=int, default=2, help="ranks the experts are spread over")
    parser.add_argument("--float64", action="store_true")
    parser.add_argument("--compare", action="store_true",
                        help="check loss and gradients against the plain model each step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if "RANK" not in os.environ:
        raise SystemExit("run it with torchrun: experts spread over processes "
                         "(torchrun --nproc-per-node 4 examples/train_moe.py)")
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.ep or args.rows % args.ep:
        raise SystemExit(f"--ep {args.ep}: expected it to divide the {world} processes and "
                         f"--rows {args.rows}")
    mesh = init_device_mesh("cpu", (world // args.ep, args.ep), mesh_dim_names=("pp", "ep"))
    share = args.rows // args.ep
    mine = slice(mesh.get_local_rank("ep") * share, (mesh.get_local_rank("ep") + 1) * share)
    dtype = torch.float64 if args.float64 else torch.float32
    model = build_model(args.model, args.layers, dtype)
    plain = copy.deepcopy(model) if args.compare else None
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=3e-3) if plain else None
    sample = {key: value[mine] for key, value in copy_task(args.rows, args.half, 0)[0].items()}
    with Pipe(model, chunks=args.chunks, schedule=args.schedule, checkpoint=args.checkpoint,
              schedule_options={"overlap": True} if args.overlap else None,
              loss_fn=SummedLoss(lm_loss, token_count), sample=sample,
              distributed=Distributed.from_mesh(mesh, expert_parallel="auto")) as pipe:
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
                counts = pipe.expert_parallel_counts
                print(f"step {step}: loss {loss.item():.4f}; this rank's experts computed "
                      f"{counts.received_rows if counts else 0} token rows so far")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
