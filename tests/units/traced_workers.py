"""Rank functions for the traced-model tests (spawned by pipeline.launching.run_ranks)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from pipeline import Distributed, Pipe, gather_state_dict
from traced_models import build, loss_options, reference


def exact_on_ranks(rank: int, world: int, kinds: list[str], schedules: list[str],
                   modes: list[str], transport: str = "auto") -> list[tuple[Any, ...]]:
    """Per (model, schedule, mode): the loss error and the worst gradient error of the
    parameters this rank holds, and how many it compared."""
    torch.set_num_threads(1)
    rows = []
    for kind in kinds:
        base, batch, target = build(kind)
        loss_expected, grads_expected = reference(copy.deepcopy(base), batch, target, kind)
        for schedule in schedules:
            for mode in modes:
                model = copy.deepcopy(base)
                with Pipe(model, chunks=4, schedule=schedule, checkpoint=mode, sample=batch,
                          distributed=Distributed(dist.group.WORLD, transport=transport),
                          **loss_options(kind)) as pipe:
                    loss = pipe.step(batch, target)
                    local = {id(p) for p in pipe.parameters()}
                errors = [(p.grad - grads_expected[name]).abs().max().item()
                          for name, p in model.named_parameters(remove_duplicate=False)
                          if id(p) in local and not p.is_meta]
                rows.append((kind, schedule, mode, abs(loss.item() - loss_expected),
                             max(errors), len(errors)))
    return rows


def state_on_ranks(rank: int, world: int) -> Any:
    """A Llama trained one SGD step on 2 ranks and gathered on rank 0, against the plain
    model trained the same way: (this rank's keys, the gathered keys, the worst difference,
    whether the plain model loads the gathered state strictly)."""
    torch.set_num_threads(1)
    base, batch, target = build("llama")
    model = copy.deepcopy(base)
    with Pipe(model, chunks=2, sample=batch, group=dist.group.WORLD,
              **loss_options("llama")) as pipe:
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
        pipe.step(batch, target)
        optimizer.step()
        local_keys = sorted(pipe.state_dict())
        state = gather_state_dict(pipe)
    if state is None:
        return local_keys, None, None, None
    plain = copy.deepcopy(base)
    reference(plain, batch, target, "llama")
    torch.optim.SGD(plain.parameters(), lr=0.5).step()
    expected = plain.state_dict()
    worst = max((state[key] - expected[key]).abs().max().item() for key in expected)
    fresh = copy.deepcopy(base)
    fresh.load_state_dict(state, strict=True)
    loaded = all(torch.equal(fresh.state_dict()[key], state[key]) for key in expected)
    return local_keys, sorted(state), worst, loaded


def mesh_exact(rank: int, world: int, combinations: list[tuple[str, str, str]]
               ) -> list[tuple[Any, ...]]:
    """The Llama on a (pp=2, dp=2) mesh, each replica on its half of the batch, against the
    plain model on the whole batch: per (data parallelism, schedule, checkpoint mode), the
    loss error, the worst gradient error of what this rank holds, and how many it compared."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    base, _, _ = build("llama")
    from traced_models import tokens

    batch, target = tokens(rows=8)
    loss_expected, grads_expected = reference(copy.deepcopy(base), batch, target, "llama")
    replica = mesh.get_local_rank("dp")
    mine = {key: value[replica * 4:(replica + 1) * 4] for key, value in batch.items()}
    rows = []
    for data_parallel, schedule, mode in combinations:
        model = copy.deepcopy(base)
        with Pipe(model, chunks=2, schedule=schedule, checkpoint=mode, sample=mine,
                  distributed=Distributed.from_mesh(mesh, data_parallel=data_parallel),
                  **loss_options("llama")) as pipe:
            loss = pipe.step(mine, target[replica * 4:(replica + 1) * 4])
            local = {id(p) for p in pipe.parameters()}
            errors = []
            for name, p in model.named_parameters(remove_duplicate=False):
                if id(p) not in local or p.is_meta:
                    continue
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                errors.append((grad - grads_expected[name]).abs().max().item())
        rows.append((data_parallel, schedule, mode, abs(loss.item() - loss_expected),
                     max(errors), len(errors)))
    return rows


def lengths_on_ranks(rank: int, world: int, lengths: list[int]) -> list[tuple[float, float]]:
    """One Pipe over steps of sequence lengths ``lengths``: (loss error, worst gradient error
    of what this rank holds) at each, against the plain model."""
    from traced_models import tokens

    torch.set_num_threads(1)
    base, batch, _ = build("llama")
    model = copy.deepcopy(base)
    errors = []
    with Pipe(model, chunks=2, schedule="zb-v", checkpoint="always", sample=batch,
              group=dist.group.WORLD, **loss_options("llama")) as pipe:
        local = {id(p) for p in pipe.parameters()}
        for length in lengths:
            batch, target = tokens(length=length, seed=length)
            loss_expected, grads_expected = reference(copy.deepcopy(base), batch, target, "llama")
            model.zero_grad()
            loss = pipe.step(batch, target)
            worst = max((p.grad - grads_expected[name]).abs().max().item()
                        for name, p in model.named_parameters(remove_duplicate=False)
                        if id(p) in local and not p.is_meta)
            errors.append((abs(loss.item() - loss_expected), worst))
    return errors


def save_on_ranks(rank: int, world: int, directory: str) -> list[str]:
    """A Llama trained two Adam steps on 2 ranks and saved with save_checkpoint; this
    rank's parameter names (the model's own)."""
    from pipeline import save_checkpoint

    torch.set_num_threads(1)
    base, batch, target = build("llama")
    model = copy.deepcopy(base)
    with Pipe(model, chunks=2, sample=batch, group=dist.group.WORLD,
              **loss_options("llama")) as pipe:
        optimizer = torch.optim.Adam(pipe.parameters(), lr=0.01)
        for _ in range(2):
            pipe.step(batch, target)
            optimizer.step()
            optimizer.zero_grad()
        save_checkpoint(pipe, optimizer, directory, step=2)
        return sorted(pipe.state_dict())


def one_token_on_ranks(rank: int, world: int) -> tuple[float, float]:
    """A Llama traced on 12 tokens steps on a one-token sequence (its code branches on that
    size: traced again, on every rank that is given the batch): (loss error, worst gradient
    error of what this rank holds) against the plain model."""
    from traced_models import tokens

    torch.set_num_threads(1)
    base, batch, _ = build("llama")
    model = copy.deepcopy(base)

    def squares(output: Any, target: Any) -> torch.Tensor:
        return (output.logits ** 2).mean()

    one, _ = tokens(length=1, seed=5, pad=0)
    plain = copy.deepcopy(base)
    expected = squares(plain(**one), None)
    expected.backward()
    grads = dict(plain.named_parameters())
    with Pipe(model, chunks=2, schedule="1f1b", sample=batch, group=dist.group.WORLD,
              loss_fn=squares) as pipe:
        local = {id(p) for p in pipe.parameters()}
        loss = pipe.step(one, one["input_ids"])
    worst = max((p.grad - grads[name].grad).abs().max().item()
                for name, p in model.named_parameters() if id(p) in local and not p.is_meta)
    return abs(loss.item() - expected.item()), worst
