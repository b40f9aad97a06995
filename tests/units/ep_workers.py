"""Rank functions for the expert-parallel tests: MoE models as written, their experts spread over ``ep``."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipeline import Distributed, Pipe, SummedLoss
from traced_models import VOCAB, lm_loss, token_count, tokens

HAND_PLAN = {"layers.*.experts": "ep_dispatch_experts"}


class HandExperts(nn.Module):
    """Experts as Hugging Face's MoE models hold them: one stacked tensor per projection,
    ``forward(hidden, top_k_index, top_k_weights)``, a loop over the experts picked."""

    def __init__(self, experts: int, width: int, inner: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inner, width) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(experts, width, inner) * 0.3)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for expert in range(self.num_experts):
            token, pick = torch.where(top_k_index == expert)
            if len(token) == 0:
                continue
            gate, up = F.linear(hidden[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            value = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, token, value * top_k_weights[token, pick, None])
        return out


class HandBlock(nn.Module):
    def __init__(self, experts: int, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts)
        self.experts = HandExperts(experts, width, 2 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.norm(x).reshape(-1, x.shape[-1])
        probabilities = torch.softmax(self.router(flat), dim=-1)
        weights, index = torch.topk(probabilities, 2, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return x + self.experts(flat, index, weights).view_as(x)


class HandMoE(nn.Module):
    """A mixture-of-experts language model written by hand (float64)."""

    def __init__(self, layers: int = 2, experts: int = 4, width: int = 16,
                 one_side: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(HandBlock(experts, width) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)
        if one_side:  # every token picks experts 0 and 1: all on the first ep rank
            with torch.no_grad():
                for block in self.layers:
                    block.router.bias.copy_(torch.tensor([30.0, 29.0] + [0.0] * (experts - 2)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def hand_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                           ignore_index=-100, reduction="sum")


def moe_model(kind: str, seed: int = 0) -> nn.Module:
    """A tiny MoE causal LM with random weights: Hugging Face's Mixtral (float32, its
    grouped expert kernel), Qwen2-MoE (a shared expert; float32) and Qwen3-MoE (float32),
    or one written by hand (float64; ``hand-one-side``: every token routed to the first ep
    rank's experts)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2))
    if kind == "qwen2-moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, intermediate_size=32, moe_intermediate_size=16,
            shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2))
    if kind == "qwen3-moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, head_dim=4, intermediate_size=32, moe_intermediate_size=16,
            num_experts=4, num_experts_per_tok=2))
    if kind in ("hand", "hand-one-side"):
        return HandMoE(one_side=kind == "hand-one-side").double()
    raise ValueError(kind)


def plan_of(kind: str) -> Any:
    return HAND_PLAN if kind.startswith("hand") else "auto"


def reference(model: nn.Module, batch: dict[str, Any], target: torch.Tensor, kind: str
              ) -> tuple[float, dict[str, torch.Tensor]]:
    """The plain model's loss (per token) and gradients, by its names, on the whole batch."""
    model.zero_grad()
    output = model(**batch)
    loss = (hand_loss if kind.startswith("hand") else lm_loss)(output, target) \
        / token_count(target)
    loss.backward()
    return loss.item(), {name: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                         for name, p in model.named_parameters()}


def ep_exact(rank: int, world: int, shape: tuple[int, ...], names: tuple[str, ...],
             cases: list[tuple[str, str, str]]) -> list[tuple[Any, ...]]:
    """Per (model, schedule, checkpoint): the loss's relative error, the worst gradient
    error of what this rank holds (whole, by the model's names) relative to the largest
    gradient, how many it compared, the rows its experts received, and how many of its
    token all-to-alls the other action of an overlapped pair covered (``NAME+overlap``
    runs NAME with its pairs)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    sharing = mesh["ep"].size() * (mesh["dp"].size() if "dp" in names else 1)
    mine_index = mesh.get_local_rank("ep") + (mesh.get_local_rank("dp") * mesh["ep"].size()
                                              if "dp" in names else 0)
    batch, target = tokens(rows=4 * sharing)
    rows = slice(4 * mine_index, 4 * (mine_index + 1))
    mine = {key: value[rows] for key, value in batch.items()}
    results = []
    for kind, schedule, mode in cases:
        base = moe_model(kind)
        if kind.startswith("hand"):
            whole, mine_batch = {"input_ids": batch["input_ids"]}, {"input_ids": mine["input_ids"]}
        else:
            whole, mine_batch = batch, mine
        loss_expected, grads_expected = reference(copy.deepcopy(base), whole, target, kind)
        model = copy.deepcopy(base)
        loss_fn = SummedLoss(hand_loss if kind.startswith("hand") else lm_loss, token_count)
        chunks = 4 if schedule.startswith("dualpipe-v") else 2  # it needs 2 x stages micro-batches
        name, _, overlap = schedule.partition("+")  # "dualpipe-v+overlap": its F&B pairs
        with Pipe(model, chunks=chunks, schedule=name, checkpoint=mode, sample=mine_batch,
                  schedule_options={"overlap": True} if overlap else None,
                  distributed=Distributed.from_mesh(mesh, expert_parallel=plan_of(kind)),
                  loss_fn=loss_fn) as pipe:
            loss = pipe.step(mine_batch, target[rows])
            local = {id(p) for p in pipe.parameters()}
            scale = max(g.abs().max().item() for g in grads_expected.values())
            errors = []
            for name, p in model.named_parameters():
                if id(p) not in local or p.is_meta:
                    continue
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
                errors.append((grad - grads_expected[name]).abs().max().item() / scale)
            received = pipe.expert_parallel_counts.received_rows
            overlapped = pipe.expert_parallel_counts.overlapped
        results.append((kind, schedule, mode, abs(loss.item() - loss_expected) / abs(loss_expected),
                        max(errors), len(errors), received, overlapped))
    return results


def ep_state(rank: int, world: int, directory: str) -> dict[str, Any]:
    """The hand-written MoE at (pp=2, ep=2), each ep rank its own rows: a plan it cannot
    take refused with the model kept; the clipped norm, one SGD step (lr=1) gathered whole
    by its names, an evaluation forward, a prediction; saved, and loaded into the plain
    model, into a (pp=2, dp=2) mesh at ep=1 and back at ep=2; each against the plain model
    stepped alike on the whole batch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipeline import gather_state_dict, load_checkpoint, load_into_model, save_checkpoint

    torch.set_num_threads(1)
    batch, target = tokens(rows=8)
    whole = {"input_ids": batch["input_ids"]}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    rows = slice(4 * mesh.get_local_rank("ep"), 4 * mesh.get_local_rank("ep") + 4)
    mine, mine_target = {"input_ids": whole["input_ids"][rows]}, target[rows]
    loss_fn = SummedLoss(hand_loss, token_count)
    found: dict[str, Any] = {}

    odd = HandMoE(experts=3)
    kept = copy.deepcopy(odd)
    try:
        Pipe(odd, chunks=2, sample=mine, loss_fn=loss_fn,
             distributed=Distributed.from_mesh(mesh, expert_parallel=HAND_PLAN))
    except ValueError as error:
        found["refused"] = str(error)
    found["kept"] = all(not p.is_meta and type(p) is torch.nn.Parameter and torch.equal(p, q)
                        for p, q in zip(odd.parameters(), kept.parameters()))

    found["mesh_refusals"] = [_refusal(lambda: Distributed.from_mesh(mesh)),
                              _refusal(lambda: Distributed.from_mesh(
                                  mesh, expert_parallel=HAND_PLAN, data_parallel="fsdp")),
                              _refusal(lambda: Distributed.from_mesh(
                                  init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp")),
                                  expert_parallel=HAND_PLAN)),
                              _refusal(lambda: Pipe(
                                  nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=2,
                                  distributed=Distributed.from_mesh(
                                      mesh, expert_parallel=HAND_PLAN)))]

    base = moe_model("hand")
    plain = copy.deepcopy(base)
    with Pipe(copy.deepcopy(base), chunks="auto", schedule="auto", sample=mine,
              loss_fn=loss_fn, distributed=Distributed.from_mesh(mesh, expert_parallel=HAND_PLAN)
              ) as pipe:  # priced with the experts' shares and exchanges
        picked = pipe.step(mine, mine_target).item()
        found["auto"] = (pipe.schedule.name, pipe.schedule.microbatches, pipe.plan is not None)
    expected_loss = hand_loss(plain(**whole), target) / token_count(target)
    found["auto_error"] = abs(picked - expected_loss.item())
    plain.zero_grad()
    (hand_loss(plain(**whole), target) / token_count(target)).backward()
    norm_expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05).item()
    torch.optim.SGD(plain.parameters(), lr=1.0).step()
    expected = plain.state_dict()
    model = copy.deepcopy(base)
    with Pipe(model, chunks=2, sample=mine, loss_fn=loss_fn,
              distributed=Distributed.from_mesh(mesh, expert_parallel=HAND_PLAN)) as pipe:
        optimizer = torch.optim.SGD(pipe.parameters(), lr=1.0)
        predicted = pipe.predict(mine, mine_target)  # measures the chunks, exchanges and all
        found["predicted"] = predicted.makespan if predicted is not None else None
        pipe.step(mine, mine_target)
        found["norm_error"] = abs(pipe.clip_grad_norm_(0.05).item() - norm_expected)
        optimizer.step()
        state = gather_state_dict(pipe)
        save_checkpoint(pipe, optimizer, directory, step=1)
        pipe.eval()  # traced in evaluation mode on first use
        with torch.no_grad():
            output = pipe(mine if mesh.get_local_rank("pp") == 0 else None)
        if output is not None:
            plain.eval()
            with torch.no_grad():
                found["eval_error"] = (output - plain(**mine)).abs().max().item()
    if state is not None:
        found["gathered_error"] = max((state[k] - expected[k]).abs().max().item()
                                      for k in expected)
        found["gathered_keys"] = sorted(state) == sorted(expected)
    dist.barrier()
    if rank == 0:
        fresh = moe_model("hand", seed=5)
        load_into_model(fresh, None, directory)
        loaded = fresh.state_dict()
        found["plain_error"] = max((loaded[k] - expected[k]).abs().max().item()
                                   for k in expected)
    other = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "ep"))
    fresh = moe_model("hand", seed=5)
    with Pipe(fresh, chunks=2, sample=mine, loss_fn=loss_fn,
              distributed=Distributed.from_mesh(other, expert_parallel=HAND_PLAN)) as pipe:
        assert load_checkpoint(pipe, None, directory) == 1
        state = gather_state_dict(pipe)
    if state is not None:
        found["ep1_error"] = max((state[k] - expected[k]).abs().max().item() for k in expected)
    fresh = moe_model("hand", seed=5)
    with Pipe(fresh, chunks=2, sample=mine, loss_fn=loss_fn,
              distributed=Distributed.from_mesh(mesh, expert_parallel=HAND_PLAN)) as pipe:
        load_checkpoint(pipe, None, directory)
        state = gather_state_dict(pipe)
    if state is not None:
        found["ep2_error"] = max((state[k] - expected[k]).abs().max().item() for k in expected)
    return found


def _refusal(call: Any) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "not refused"


def ep_silent_peer(rank: int, world: int) -> str:
    """Rank 1 never joins a token exchange: rank 0's gives up after its timeout (2 s),
    saying so; rank 1 waits out that time."""
    import time

    import torch.distributed as dist

    from units.ep_dispatch import Exchange

    exchange = Exchange(dist.group.WORLD, moe_model("hand"), timeout=2.0)
    if rank == 1:
        time.sleep(6.0)
        return ""
    hidden = torch.randn(5, 16, dtype=torch.float64)
    index = torch.tensor([[0, 3]] * 5)
    weights = torch.full((5, 2), 0.5, dtype=torch.float64)
    parameters = list(exchange.model.layers[0].experts.parameters())
    start = time.perf_counter()
    try:
        exchange.run(hidden, index, weights, [p[:2] for p in parameters], "layers.0.experts")
    except RuntimeError as error:
        return f"{time.perf_counter() - start:.1f}s: {error}"
    return "completed"
