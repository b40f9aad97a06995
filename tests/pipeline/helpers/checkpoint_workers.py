"""Functions that run inside spawned gloo ranks for the checkpoint tests (importable by name)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dist_workers import batch, deep_mlp

STEPS_BEFORE_SAVE = 3
STEPS_AFTER_LOAD = 3
CHUNKS = 4

OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = {
    "adam": lambda parameters: torch.optim.Adam(parameters, lr=0.01),
    "sgd": lambda parameters: torch.optim.SGD(parameters, lr=0.05, momentum=0.9),
}


def named_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """This process's parameters by model name (a rank's remote layers are on meta)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if not p.is_meta}


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state by ``"<parameter name>.<key>"`` (tensors cloned)."""
    state: dict[str, Any] = {}
    for name, parameter in model.named_parameters():
        for key, value in optimizer.state.get(parameter, {}).items():
            state[f"{name}.{key}"] = value.clone() if isinstance(value, torch.Tensor) else value
    return state


def portable(tree: Any) -> Any:
    """Tensors as numpy arrays: a rank's result crosses a Queue as it leaves, and torch would
    share a tensor's memory through a handle that dies with the rank."""
    if isinstance(tree, torch.Tensor):
        return tree.numpy()
    if isinstance(tree, dict):
        return {key: portable(value) for key, value in tree.items()}
    return tree


def reference_run(optimizer_name: str, steps: int) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    """The unpipelined model trained ``steps`` steps: the truth a resumed pipeline must match."""
    model = deep_mlp()
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    for step in range(steps):
        x, y = batch(seed=step)
        optimizer.zero_grad()
        nn.MSELoss()(model(x), y).backward()
        optimizer.step()
    return model, optimizer


def train_pipe(pipe: Any, optimizer: torch.optim.Optimizer, steps: range, rank: int = 0) -> None:
    """``steps`` training steps; with a group, the input and target only where they are read."""
    alone = pipe.ranks.size == 1
    first = alone or pipe.schedule.placement[0] == rank
    last = alone or pipe.schedule.placement[-1] == rank
    for step in steps:
        x, y = batch(seed=step)
        optimizer.zero_grad()
        pipe.step(x if first else None, y if last else None)
        optimizer.step()


def _group_pipe(optimizer_name: str) -> tuple[Any, torch.optim.Optimizer]:
    from pipeline import Pipe

    pipe = Pipe(deep_mlp(), chunks=CHUNKS, schedule="1f1b", loss_fn=nn.MSELoss(),
                group=dist.group.WORLD)
    return pipe, OPTIMIZERS[optimizer_name](pipe.parameters())


def train_and_save(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Per optimizer: train on ``world`` ranks, save to ``directory/<optimizer>``; what was saved."""
    from pipeline.saving.checkpoints import save_checkpoint

    torch.set_num_threads(1)
    saved: dict[str, Any] = {}
    for name in OPTIMIZERS:
        pipe, optimizer = _group_pipe(name)
        train_pipe(pipe, optimizer, range(STEPS_BEFORE_SAVE), rank)
        torch.manual_seed(1000 + rank)  # each rank's generator in its own state
        save_checkpoint(pipe, optimizer, Path(directory) / name, STEPS_BEFORE_SAVE)
        saved[name] = {"parameters": named_parameters(pipe.model),
                       "optimizer": optimizer_state(pipe.model, optimizer),
                       "rng": torch.get_rng_state()}
        pipe.close()
    return dict(portable(saved))


def resume_and_train(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Per optimizer: load on ``world`` ranks, train on; the step, RNG and parameters after."""
    from pipeline.saving.checkpoints import load_checkpoint

    torch.set_num_threads(1)
    resumed: dict[str, Any] = {}
    for name in OPTIMIZERS:
        pipe, optimizer = _group_pipe(name)
        step = load_checkpoint(pipe, optimizer, Path(directory) / name)
        rng = torch.get_rng_state()
        train_pipe(pipe, optimizer, range(step, step + STEPS_AFTER_LOAD), rank)
        resumed[name] = {"step": step, "rng": rng, "parameters": named_parameters(pipe.model)}
        pipe.close()
    return dict(portable(resumed))


def mesh_train_and_save(rank: int, world: int, directory: str) -> dict[str, Any]:
    """(pp, dp) = (2, 2) from a device mesh, Adam: each replica trains on its own batches,
    all four ranks save one checkpoint (replicas write the same keys); what rank 0 holds."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeline import Pipe, save_checkpoint

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    replica = mesh.get_local_rank("dp")
    pipe = Pipe(deep_mlp(), chunks=CHUNKS, loss_fn=nn.MSELoss(), mesh=mesh)
    optimizer = OPTIMIZERS["adam"](pipe.parameters())
    for step in range(STEPS_BEFORE_SAVE):
        x, y = batch(seed=100 * replica + step)
        optimizer.zero_grad()
        pipe.step(x, y)
        optimizer.step()
    save_checkpoint(pipe, optimizer, directory, STEPS_BEFORE_SAVE)
    held = named_parameters(pipe.model)
    pipe.close()
    return dict(portable(held))
