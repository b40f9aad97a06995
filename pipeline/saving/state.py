"""What one process writes to a checkpoint and reads back: its layers and optimizer, by name.

Saving only reads: the model's state dict and the optimizer's own state and
hyperparameters, under each parameter's model names. DCP's ``get_state_dict`` is not
used, because it creates a fresh optimizer's state by running ``optimizer.step()`` with
zero gradients (lr 0) on the live optimizer, which moves Adam's step count and
Rprop's step sizes: a save before the first step changed training. A parameter without
state is saved without state, and loads as such.

Loading is strict, as ``load_state_dict(strict=True)``: every key this process needs is
in the checkpoint, every model key of the checkpoint is one of this model's, shapes
agree, and the optimizer's kind agrees (the hyperparameter and state keys). The keys of
a tied parameter (a head tied to the embedding) are read apart and must hold one value.
Everything is checked against the index before a byte is read; tied keys are read
first, into placeholders, and compared; the model's other tensors are then read in
place, the optimizer's into placeholders applied once every rank read its part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from pipeline.saving.format import CheckpointError

STEP_KEY = "step"
RNG_PREFIX = "rng.cpu.rank"
_SHOWN = 8  # keys named in an error, at most


@dataclass(frozen=True)
class Layout:
    """What one process holds of the model, and what it must know of the whole."""

    module: nn.Module  # this process's layers, named as in the whole model
    whole_keys: frozenset[str]  # every state key of the whole model (strict loading)
    ties: tuple[tuple[str, ...], ...]  # the keys of each parameter held under several


def tied_groups(module: nn.Module) -> tuple[tuple[str, ...], ...]:
    """The parameter names of each parameter ``module`` holds under several names."""
    return tuple(tuple(names) for names in _names(module).values() if len(names) > 1)


def rng_key(rank: int) -> str:
    return f"{RNG_PREFIX}{rank}"


def _names(module: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return names


def _listed(keys: Sequence[str]) -> str:
    shown = ", ".join(sorted(keys)[:_SHOWN])
    return f"[{shown}{', ...' if len(keys) > _SHOWN else ''}] ({len(keys)})"


# -- saving ------------------------------------------------------------------------------------


def save_state(layout: Layout, optimizer: torch.optim.Optimizer | None, step: int,
               rank: int) -> dict[str, Any]:
    """This process's entries (the live tensors, not copies); nothing is changed."""
    state: dict[str, Any] = {"model": get_model_state_dict(layout.module)}
    if optimizer is not None:
        names = _names(layout.module)
        states: dict[str, Any] = {}
        groups: dict[str, Any] = {}
        for group in optimizer.param_groups:
            hyper = {key: value for key, value in group.items()
                     if key not in ("params", "param_names")}
            for parameter in group["params"]:
                for name in names[id(parameter)]:  # every name: any cut finds its own
                    groups[name] = dict(hyper)
                    if optimizer.state.get(parameter):
                        states[name] = dict(optimizer.state[parameter])
        state["optim"] = {"state": states, "param_groups": groups}
    state[STEP_KEY] = torch.tensor(int(step), dtype=torch.int64)
    state[rng_key(rank)] = torch.get_rng_state()
    return state


# -- loading -----------------------------------------------------------------------------------


@dataclass
class Reading:
    """The placeholders of one load, by checkpoint key, and where each goes."""

    directory: Path
    flat: dict[str, Any] = field(default_factory=dict)  # checkpoint key -> placeholder
    model: dict[str, str] = field(default_factory=dict)  # local model key -> checkpoint key
    ties: list[list[str]] = field(default_factory=list)  # model names that must agree
    tied_keys: dict[str, str] = field(default_factory=dict)  # their checkpoint keys
    optimizer: list[tuple[nn.Parameter, dict[str, str], dict[str, str]]] = field(
        default_factory=list)  # parameter, its hyperparameters' keys, its state's keys
    rng: str | None = None


def _saved(metadata: Metadata) -> tuple[dict[str, str], dict[str, dict[str, str]],
                                        dict[str, dict[str, str]], dict[str, str]]:
    """The checkpoint's keys by role: model names, optimizer state and hyperparameters per
    parameter name, and the top-level entries (step, generators)."""
    model: dict[str, str] = {}
    states: dict[str, dict[str, str]] = {}
    groups: dict[str, dict[str, str]] = {}
    top: dict[str, str] = {}
    for key, path in (metadata.planner_data or {}).items():
        if len(path) == 2 and path[0] == "model":
            model[str(path[1])] = key
        elif len(path) == 4 and path[0] == "optim" and path[1] in ("state", "param_groups"):
            (states if path[1] == "state" else groups).setdefault(
                str(path[2]), {})[str(path[3])] = key
        elif len(path) == 1:
            top[str(path[0])] = key
    return model, states, groups, top


def _placeholder(entry: Any, like: torch.Tensor) -> Any:
    if not isinstance(entry, TensorStorageMetadata):
        return None  # a bytes entry: replaced as it is read
    if tuple(entry.size) == tuple(like.shape):
        return torch.zeros_like(like, dtype=entry.properties.dtype)  # sharded like ``like``
    return torch.zeros(entry.size, dtype=entry.properties.dtype)


def plan_reading(layout: Layout, optimizer: torch.optim.Optimizer | None, metadata: Metadata,
                 directory: Path, rank: int) -> Reading:
    """The placeholders for this process, once the checkpoint was found to fit.

    Raises:
        CheckpointError: keys missing or unexpected, a shape that differs, or an optimizer
            of another kind, each named.
    """
    model, states, groups, top = _saved(metadata)
    entries = metadata.state_dict_metadata
    live = get_model_state_dict(layout.module)
    reading = Reading(directory)
    missing = [f"model.{name}" for name in live if name not in model]
    unexpected = [f"model.{name}" for name in model if name not in layout.whole_keys]
    unexpected += [f"optim.*.{name}" for name in {*states, *groups}
                   if name not in layout.whole_keys]
    if STEP_KEY not in top:
        missing.append(STEP_KEY)
    for names in layout.ties:
        if set(live) & set(names):
            reading.ties.append(list(names))
            missing += [f"model.{name}" for name in names if name not in model
                        and name not in live]
    if optimizer is not None:
        missing += _plan_optimizer(layout, optimizer, groups, states, entries, reading)
    if missing or unexpected:
        raise CheckpointError(
            f"the checkpoint at {directory} does not fit this model (loading is strict, as "
            f"load_state_dict(strict=True)): missing keys {_listed(missing)}, unexpected keys "
            f"{_listed(unexpected)}; it was saved from another model"
            + (", or without an optimizer" if any(k.startswith("optim") for k in missing)
               else ""))
    tied = {name for names in reading.ties for name in names}
    like: dict[str, Any] = dict(live)  # what each model key read here must look like
    for group in reading.ties:
        local = next(name for name in group if name in live)
        for name in group:
            like.setdefault(name, live[local])
    shapes = []
    for name in sorted(like):
        value, entry = like[name], entries[model[name]]
        if isinstance(value, torch.Tensor) != isinstance(entry, TensorStorageMetadata) or (
                isinstance(entry, TensorStorageMetadata)
                and tuple(entry.size) != tuple(value.shape)):
            saved = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else "bytes"
            given = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            shapes.append(f"model.{name}: saved {saved}, this model {given}")
        elif name in live and name not in tied and isinstance(value, torch.Tensor):
            reading.flat[model[name]] = value  # read in place
        else:
            reading.flat[model[name]] = _placeholder(entry, value)
    if shapes:
        raise CheckpointError(f"the checkpoint at {directory} holds tensors of other shapes "
                              f"than this model: {'; '.join(shapes[:_SHOWN])}")
    reading.model = {name: model[name] for name in live}
    reading.tied_keys = {name: model[name] for name in tied}
    reading.flat[top[STEP_KEY]] = torch.zeros((), dtype=torch.int64)
    reading.rng = next((top[k] for k in (rng_key(rank), rng_key(0)) if k in top), None)
    if reading.rng is not None:
        reading.flat[reading.rng] = torch.get_rng_state()  # of the right size, filled in
    return reading


def _plan_optimizer(layout: Layout, optimizer: torch.optim.Optimizer,
                    groups: dict[str, dict[str, str]], states: dict[str, dict[str, str]],
                    entries: dict[str, Any], reading: Reading) -> list[str]:
    """Placeholders for the optimizer's entries; the keys missing. Raises on another kind."""
    names = _names(layout.module)
    missing: list[str] = []
    for group in optimizer.param_groups:
        expected = sorted(key for key in group if key not in ("params", "param_names"))
        for parameter in group["params"]:
            name = names[id(parameter)][0]
            if name not in groups:
                missing.append(f"optim.param_groups.{name}.*")
                continue
            saved_state = states.get(name, {})
            live_state = optimizer.state.get(parameter) or {}
            if sorted(groups[name]) != expected or (
                    live_state and saved_state and sorted(live_state) != sorted(saved_state)):
                saved_keys = {*groups[name], *saved_state}
                live_keys = {*expected, *live_state}
                raise CheckpointError(
                    f"the checkpoint at {reading.directory} was saved with another kind of "
                    f"optimizer than this {type(optimizer).__name__}: for {name}, keys missing "
                    f"{sorted(live_keys - saved_keys)}, unexpected "
                    f"{sorted(saved_keys - live_keys)}")
            for key in (*groups[name].values(), *saved_state.values()):
                reading.flat[key] = _placeholder(entries[key], parameter)
            reading.optimizer.append((parameter, groups[name], saved_state))
    return missing


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def check_ties(reading: Reading, read: dict[str, Any]) -> None:
    """Raise CheckpointError where the values ``read`` give one tied parameter two values."""
    for names in reading.ties:
        first = read[reading.tied_keys[names[0]]]
        for name in names[1:]:
            value = read[reading.tied_keys[name]]
            if value.shape != first.shape or not torch.equal(_local(value), _local(first)):
                raise CheckpointError(
                    f"model.{names[0]} and model.{name} are one parameter in this model (tied), "
                    f"but the checkpoint at {reading.directory} holds different values for "
                    f"them: it was saved from a model without this tie (load it into an "
                    f"untied model, or save it from the tied one)")


def optimizer_state(reading: Reading, optimizer: torch.optim.Optimizer | None
                    ) -> dict[str, Any] | None:
    """What was read for ``optimizer``, as its ``load_state_dict`` takes it.

    Raises:
        CheckpointError: parameters of one of the optimizer's groups were saved with
            different hyperparameters.
    """
    if optimizer is None:
        return None
    read = {id(parameter): (hyper, state) for parameter, hyper, state in reading.optimizer}
    loaded: dict[str, Any] = {"state": {}, "param_groups": []}
    index = 0
    for group in optimizer.param_groups:
        saved = {key: value for key, value in group.items() if key != "params"}
        first: dict[str, Any] | None = None
        for parameter in group["params"]:
            hyper_keys, state_keys = read[id(parameter)]
            hyper = {key: reading.flat[k] for key, k in hyper_keys.items()}
            if first is not None and not _same(hyper, first):
                raise CheckpointError(
                    f"the checkpoint at {reading.directory} gives the parameters of one of "
                    f"this optimizer's param groups different hyperparameters ({first} and "
                    f"{hyper}): group the parameters as the saving optimizer did")
            first = hyper
            if state_keys:
                loaded["state"][index] = {key: reading.flat[k] for key, k in state_keys.items()}
            index += 1
        saved.update(first or {})
        saved["params"] = list(range(index - len(group["params"]), index))
        loaded["param_groups"].append(saved)
    return loaded


def apply(reading: Reading, layout: Layout, optimizer: torch.optim.Optimizer | None,
          optimizer_loaded: dict[str, Any] | None) -> int:
    """Put what was read into the model, the optimizer and the generator; the step."""
    model_state = {name: reading.flat[key] for name, key in reading.model.items()}
    set_model_state_dict(layout.module, model_state, options=StateDictOptions(strict=True))
    if optimizer is not None and optimizer_loaded is not None:
        optimizer.load_state_dict(optimizer_loaded)
    if reading.rng is not None:
        torch.set_rng_state(reading.flat[reading.rng])
    return int(reading.flat[STEP_KEY].item())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and torch.equal(_local(a), _local(b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)
