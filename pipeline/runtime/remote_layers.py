"""What a rank holds of a model: the parameters several stages share, and the layers it frees.

A rank runs its own stages' layers and moves the rest to ``meta``. Parameters (or whole
modules) that layers on several stages use are what needs care: they are found before
anything moves, their gradients are summed across the stages holding them after each
step, and freeing a remote layer must never move what a local layer holds too.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from schedules import Schedule

from pipeline.compute.shared import SharedParameter, stages_using, unique


def shared_across_stages(
    model: nn.Sequential, balance: Sequence[int], schedule: Schedule, local_layers: Sequence[int],
    shared: dict[int, SharedParameter],
) -> tuple[list[Synced], dict[int, int]]:
    """The parameters used on several stages, and each shared parameter's owner stage.

    Their gradients are summed across those stages after each step (the same list, in
    model order, on every rank); each is counted once, on its first user's stage, when
    clipping.

    Raises:
        ValueError: such parameters in a model on the meta device (materialising each
            rank's layers would untie them).
    """
    local = set(local_layers)
    ordered = [p for p in unique(model.parameters()) if id(p) in shared]
    synced = [
        Synced(p if local.intersection(shared[id(p)].layers) else None, tuple(p.shape), p.dtype)
        for p in ordered if len(stages_using(shared[id(p)], balance, schedule.placement)) > 1
    ]
    if synced and any(p.is_meta for p in model.parameters()):
        names = ", ".join(shared[id(p)].name for p in ordered)
        raise ValueError(
            f"a model on the meta device with parameters shared across stages ({names}) is "
            f"not supported yet: materialising each rank's layers would untie them; build "
            f"the model on the CPU, or cut it so that the tied layers share a stage"
        )
    owner_stage = {id(p): schedule.placement[_chunk_of(shared[id(p)].owner, balance)]
                   for p in ordered}
    return synced, owner_stage


def free_remote_layers(model: nn.Sequential, local_layers: Sequence[int],
                        shared: dict[int, SharedParameter]) -> None:
    """Move the layers this rank does not run to ``meta``, keeping what local layers share.

    ``Module.to`` converts a parameter in place, so a head tied to a local embedding
    would take the embedding with it: the remote layer gets a meta placeholder instead.
    A module object that a local layer holds too (one block at several positions, ALBERT
    style) is replaced at the remote position by a meta copy, never moved itself.
    """
    local = set(local_layers)
    kept = {key for key, info in shared.items() if local.intersection(info.layers)}
    local_modules = {id(module) for index in local for module in model[index].modules()}
    for index, layer in enumerate(model):
        if index in local:
            continue
        if id(layer) in local_modules:
            model[index] = _meta_copy(layer)
            continue
        _detach_shared_children(layer, local_modules)
        for module in layer.modules():
            for name, parameter in list(module._parameters.items()):
                if parameter is not None and id(parameter) in kept:
                    module._parameters[name] = nn.Parameter(
                        torch.empty_like(parameter, device="meta"), parameter.requires_grad
                    )
        layer.to("meta")  # frees what this rank does not run


def _detach_shared_children(layer: nn.Module, local_modules: set[int]) -> None:
    """Replace, inside a remote layer, every submodule a local layer holds by a meta copy."""
    for parent in list(layer.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None and id(child) in local_modules:
                parent._modules[name] = _meta_copy(child)


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose tensors are on ``meta`` (nothing allocated, nothing shared)."""
    memo = {id(t): torch.empty_like(t, device="meta") for t in
            [*module.parameters(), *module.buffers()]}
    for parameter in module.parameters():
        memo[id(parameter)] = nn.Parameter(memo[id(parameter)], parameter.requires_grad)
    return copy.deepcopy(module, memo)


@dataclass(frozen=True)
class Synced:
    """A parameter used on several stages: this rank's copy (None if it holds none), its shape."""

    parameter: nn.Parameter | None
    shape: tuple[int, ...]
    dtype: torch.dtype


def _chunk_of(layer: int, balance: Sequence[int]) -> int:
    total = 0
    for chunk, count in enumerate(balance):
        total += count
        if layer < total:
            return chunk
    raise ValueError(f"layer {layer} is beyond the {total} layers of the balance")
