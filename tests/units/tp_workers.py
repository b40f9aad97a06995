"""Rank functions for the tensor-parallel tests: Hugging Face models as written, in a mesh."""

from __future__ import annotations

import copy
from typing import Any

import torch

from pipeline import Distributed, Pipe
from traced_models import VOCAB, lm_loss, loss_options, reference, tokens

LLAMA_PLAN = {"model.layers.*.self_attn.q_proj": "colwise",
              "model.layers.*.self_attn.k_proj": "colwise",
              "model.layers.*.self_attn.v_proj": "colwise",
              "model.layers.*.self_attn.o_proj": "rowwise",
              "model.layers.*.mlp.gate_proj": "colwise",
              "model.layers.*.mlp.up_proj": "colwise",
              "model.layers.*.mlp.down_proj": "rowwise"}


def hf_model(kind: str, layers: int = 4, kv_heads: int = 2, seed: int = 0) -> torch.nn.Module:
    """A tiny Hugging Face causal LM (4 heads, ``kv_heads`` key/value heads, a tied head for
    the Llama), random weights, float64."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                  num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=kv_heads, max_position_embeddings=64,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**common, tie_word_embeddings=True))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif kind == "qwen3":  # per-head q_norm and k_norm: replicated_with_grad_allreduce
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=4))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(**common, sliding_window=None))
    elif kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=16, n_layer=layers, n_head=4, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2))
        with torch.no_grad():  # its biases start at zero: make them count
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    parameter.normal_(0, 0.1)
    else:
        raise ValueError(kind)
    return model.double()


GPT2_PLAN = {"transformer.h.*.attn.c_attn": "packed_colwise",  # 3 packs, from split_size
             "transformer.h.*.attn.c_proj": "rowwise",
             "transformer.h.*.mlp.c_fc": "colwise",
             "transformer.h.*.mlp.c_proj": "rowwise"}


def plan_of(name: str) -> Any:
    return "auto" if name == "auto" else {"llama": LLAMA_PLAN, "gpt2": GPT2_PLAN}[name]


def grad_errors(model: torch.nn.Module, local: set[int], expected: dict[str, torch.Tensor]
                ) -> list[float]:
    from torch.distributed.tensor import DTensor

    errors = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in local or p.is_meta or p.grad is None:
            continue
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        errors.append((grad - expected[name]).abs().max().item())
    return errors


def backward_times(timeline: Any) -> dict[str, float] | None:
    """Seconds of the timeline's I, W and whole backward actions (rank 0; None elsewhere)."""
    if timeline is None:
        return None
    times: dict[str, float] = {}
    for event in timeline.events:
        kind = event.action.op.name
        times[kind] = times.get(kind, 0.0) + event.duration
    return times


def tp_exact(rank: int, world: int, shape: tuple[int, ...], names: tuple[str, ...],
             cases: list[tuple[str, str, str, str]]) -> list[tuple[Any, ...]]:
    """Per (model, plan, schedule, checkpoint): the loss error, the worst gradient error of
    what this rank holds (whole, by the model's names), how many it compared, and the
    all-reduces counted (forward, backward)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    replicas = mesh["dp"].size() if "dp" in names else 1
    replica = mesh.get_local_rank("dp") if "dp" in names else 0
    batch, target = tokens(rows=4 * replicas)
    rows = 4
    mine = {key: value[replica * rows:(replica + 1) * rows] for key, value in batch.items()}
    mine_target = target[replica * rows:(replica + 1) * rows]
    results = []
    for kind, plan, schedule, mode in cases:
        base = hf_model(kind, layers=4 if kind == "llama" else 2)  # traces cost per layer
        loss_expected, grads_expected = reference(copy.deepcopy(base), batch, target, kind)
        model = copy.deepcopy(base)
        data_parallel = "fsdp" if replicas > 1 else "replicate"
        with Pipe(model, chunks=2, schedule=schedule, checkpoint=mode, sample=mine,
                  distributed=Distributed.from_mesh(mesh, data_parallel=data_parallel,
                                                    tensor_parallel=plan_of(plan)),
                  **loss_options(kind)) as pipe:
            loss = pipe.step(mine, mine_target)
            local = {id(p) for p in pipe.parameters()}
            errors = grad_errors(model, local, grads_expected)
            counts = pipe.tensor_parallel_counts
            timeline = pipe.timeline
            results.append((kind, plan, schedule, mode, abs(loss.item() - loss_expected),
                            max(errors), len(errors), counts.forward, counts.backward,
                            backward_times(timeline)))
    return results


__all__ = ["hf_model", "lm_loss", "plan_of", "tp_exact"]


def tp_state(rank: int, world: int, directory: str) -> dict[str, Any]:
    """The Llama at (pp=2, tp=2): the clipped norm against the plain model's, one SGD step
    (lr=1) gathered whole by its names, saved; loaded into the plain model (strictly) and
    into a (pp=2, dp=2) Pipe at tp=1; each against the plain model stepped alike."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipeline import gather_state_dict, load_checkpoint, load_into_model, save_checkpoint

    torch.set_num_threads(1)
    batch, target = tokens(rows=4)
    base = hf_model("llama")
    plain = copy.deepcopy(base)
    plain.zero_grad()
    (lm_loss(plain(**batch), target) / (target[:, 1:] != -100).sum()).backward()
    norm_expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05).item()
    torch.optim.SGD(plain.parameters(), lr=1.0).step()
    expected = plain.state_dict()
    found: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    model = copy.deepcopy(base)
    try:  # the head is tied to the embedding: refused before any layer is freed or split
        Pipe(model, chunks=2, sample=batch, **loss_options("llama"),
             distributed=Distributed.from_mesh(mesh, tensor_parallel={"lm_head": "colwise"}))
    except ValueError as error:
        found["refused"] = str(error)
    found["kept"] = all(not p.is_meta and type(p) is torch.nn.Parameter and
                        torch.equal(p, q) for p, q in zip(model.parameters(), base.parameters()))
    model = copy.deepcopy(base)
    with Pipe(model, chunks=2, sample=batch, **loss_options("llama"),
              distributed=Distributed.from_mesh(mesh, tensor_parallel="auto")) as pipe:
        optimizer = torch.optim.SGD(pipe.parameters(), lr=1.0)
        predicted = pipe.predict(batch, target)  # measures the chunks, all-reduces and all
        found["predicted"] = predicted.makespan if predicted is not None else None
        found["probed_reduces"] = pipe.tensor_parallel_counts.forward
        pipe.step(batch, target)
        found["norm_error"] = abs(pipe.clip_grad_norm_(0.05).item() - norm_expected)
        optimizer.step()
        state = gather_state_dict(pipe)
        save_checkpoint(pipe, optimizer, directory, step=1)
        pipe.eval()  # traced at one rank's sizes in evaluation mode on first use
        with torch.no_grad():  # the batch on the first stage only: the last traces alone
            output = pipe(batch if mesh.get_local_rank("pp") == 0 else None)
        if output is not None:
            plain.eval()
            with torch.no_grad():
                logits = plain(**batch).logits
            found["eval_error"] = (output.logits - logits).abs().max().item()
    if state is not None:
        found["gathered_error"] = max((state[k] - expected[k]).abs().max().item()
                                      for k in expected)
        found["gathered_keys"] = sorted(state) == sorted(expected)
    dist.barrier()
    if rank == 0:
        fresh = hf_model("llama", seed=5)
        load_into_model(fresh, None, directory)
        loaded = fresh.state_dict()
        found["plain_error"] = max((loaded[k] - expected[k]).abs().max().item()
                                   for k in expected)
        found["plain_tied"] = fresh.lm_head.weight is fresh.model.embed_tokens.weight
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    fresh = hf_model("llama", seed=5)
    with Pipe(fresh, chunks=2, sample=batch, **loss_options("llama"),
              distributed=Distributed.from_mesh(other)) as pipe:
        assert load_checkpoint(pipe, None, directory) == 1
        state = gather_state_dict(pipe)
    if state is not None:
        found["tp1_error"] = max((state[k] - expected[k]).abs().max().item() for k in expected)
    for how in ("checkpoint", "state_dict"):
        fresh = hf_model("llama", seed=5)
        with Pipe(fresh, chunks=2, sample=batch, **loss_options("llama"),
                  distributed=Distributed.from_mesh(mesh, tensor_parallel="auto")) as pipe:
            if how == "checkpoint":
                load_checkpoint(pipe, None, directory)
            else:
                pipe.load_state_dict(expected)
            state = gather_state_dict(pipe)
        if state is not None:
            found[f"tp2_{how}_error"] = max((state[k] - expected[k]).abs().max().item()
                                            for k in expected)
    return found


def tp_random(rank: int, world: int) -> float:
    """GPT-2 with dropout everywhere at (pp=2, tp=2), each rank's generator seeded apart:
    the largest difference between the tp ranks' gradients of the parameters they both hold
    whole (norms, embeddings, row-split biases). Regions every rank computes whole draw the
    same numbers on each, or those gradients part."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    model = hf_model("gpt2", layers=2)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.2
    batch, target = tokens(rows=4)
    torch.manual_seed(100 + rank)
    with Pipe(model, chunks=2, sample=batch, **loss_options("gpt2"),
              distributed=Distributed.from_mesh(mesh, tensor_parallel=plan_of("gpt2"))) as pipe:
        pipe.step(batch, target)
        whole = [p.grad.to_local() if isinstance(p, DTensor) else p.grad
                 for p in pipe.parameters() if p.grad is not None
                 and (not isinstance(p, DTensor) or p.placements == (Replicate(),))]
    flat = torch.cat([g.flatten() for g in whole])
    other = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(other, flat, group=mesh["tp"].get_group())
    return (other[0] - other[1]).abs().max().item()


def tp_silent_peer(rank: int, world: int) -> str:
    """Rank 1 never joins a tensor-parallel all-reduce: rank 0's gives up after its timeout
    (2 s), saying so; rank 1 waits out that time."""
    import time

    import torch.distributed as dist

    from units.tp_graph import Boundaries

    boundaries = Boundaries(dist.group.WORLD, timeout=2.0)
    if rank == 1:
        time.sleep(6.0)
        return ""
    start = time.perf_counter()
    try:
        boundaries.summed(torch.ones(3), backward=False)
    except RuntimeError as error:
        return f"{time.perf_counter() - start:.1f}s: {error}"
    return "completed"
