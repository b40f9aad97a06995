"""Resolve a Pipe's stages, balance and devices, and cut the model into chunks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from partitioners import uniform
from schedules import Schedule, get_schedule, validate
from schedules.registry import schedule_info


def check_model(model: Any) -> nn.Sequential:
    """Return ``model`` if it is a non-empty nn.Sequential, else raise TypeError/ValueError."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"Pipe needs an nn.Sequential (its layers are what gets cut into stages), "
            f"got {type(model).__name__}; wrap your layers: nn.Sequential(layer1, layer2, ...)"
        )
    if len(model) == 0:
        raise ValueError("Pipe needs an nn.Sequential with at least one layer, got an empty one")
    return model


def check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def build_schedule(
    schedule: str | Schedule, stages: int, microbatches: int, options: dict[str, Any]
) -> Schedule:
    """The Schedule to run: built by name, or the given one checked against the counts."""
    if isinstance(schedule, Schedule):
        if schedule.stages != stages or schedule.microbatches != microbatches:
            raise ValueError(
                f"the Schedule was built for stages={schedule.stages}, "
                f"microbatches={schedule.microbatches}, but this Pipe has stages={stages}, "
                f"chunks={microbatches}; build it with those counts"
            )
        validate(schedule)  # a missing or deadlocked action raises here, not mid-step
        return schedule
    if not isinstance(schedule, str):
        raise TypeError(f"schedule must be a name or a Schedule, got {type(schedule).__name__}")
    return get_schedule(schedule, stages, microbatches, **options)


def chunks_per_stage(schedule: str | Schedule, options: dict[str, Any]) -> int:
    """How many model chunks each stage holds under ``schedule`` (a registry fact)."""
    if isinstance(schedule, Schedule):
        return schedule.chunks // schedule.stages
    if not isinstance(schedule, str):
        raise TypeError(f"schedule must be a name or a Schedule, got {type(schedule).__name__}")
    return schedule_info(schedule).chunks(**options)


def uniform_balance(layers: int, parts: int) -> list[int]:
    """Layers per part, as even as possible (``partitioners.uniform``), with a Pipe's wording."""
    if parts > layers:
        raise ValueError(
            f"cannot cut {layers} layers into {parts} model chunks: expected at most "
            f"{layers} chunks (one layer each at least)"
        )
    return uniform(layers, parts)


def check_balance(balance: Sequence[int], layers: int, parts: int) -> list[int]:
    """Return ``balance`` as a list if it has ``parts`` positive entries summing to ``layers``."""
    balance = list(balance)
    if len(balance) != parts:
        raise ValueError(
            f"balance must have one entry per model chunk: expected {parts}, got "
            f"{len(balance)} ({balance})"
        )
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in balance):
        raise ValueError(f"balance entries must be ints >= 1, got {balance}")
    if sum(balance) != layers:
        raise ValueError(
            f"balance must sum to the model's {layers} layers, got {balance} "
            f"(sum {sum(balance)})"
        )
    return balance


def default_devices(stages: int) -> list[torch.device]:
    """The CUDA devices round-robin when there are any, else the CPU for every stage."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return [torch.device("cuda", stage % count) for stage in range(stages)]
    return [torch.device("cpu")] * stages


def slices(model: nn.Sequential, balance: Sequence[int]) -> list[tuple[int, nn.Sequential]]:
    """Cut ``model`` into consecutive slices: (first layer index, layers sharing the modules)."""
    found = []
    first = 0
    for count in balance:
        found.append((first, nn.Sequential(*[model[i] for i in range(first, first + count)])))
        first += count
    return found


def resolve_balance(
    balance: Any,
    model: nn.Sequential,
    parts: int,
    sample: Any,
    schedule_name: str,
    microbatches: int,
) -> list[int] | None:
    """A list of layers per chunk, or None when it must wait for a sample ("time", no sample)."""
    if balance is None or balance == "uniform":
        return uniform_balance(len(model), parts)
    if isinstance(balance, str):
        if balance not in ("time", "params"):
            raise ValueError(
                f"unknown balance {balance!r}; expected a list of layer counts, "
                f"'time', 'params' or 'uniform'"
            )
        uniform_balance(len(model), parts)
        if balance == "time" and sample is None:
            return None
        return profiled_balance(model, parts, balance, sample)
    return check_balance(balance, len(model), parts)


def profiled_balance(model: nn.Sequential, parts: int, by: str, sample: Any) -> list[int]:
    """Balance by measured time or by parameter bytes, through the partitioners package."""
    from partitioners import balance as balance_costs
    from partitioners import profile

    if by == "params":
        weights = [
            float(sum(p.numel() * p.element_size() for p in layer.parameters())) for layer in model
        ]
        return list(balance_costs(weights, parts, by="time"))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    costs = profile(model, sample, device=str(device), progress=False)
    return list(balance_costs(costs, parts, by="time"))


def build_chunks(
    model: nn.Sequential,
    balance: Sequence[int],
    schedule: Schedule,
    devices: Sequence[torch.device],
    stages: Sequence[int],
    make_chunk: Any,
) -> dict[int, Any]:
    """Move each chunk of the listed stages onto its stage's device and wrap it.

    Args:
        model: the whole model; its modules are shared, not copied.
        balance: layers per chunk (``schedule.chunks`` entries).
        schedule: gives each chunk's stage (``placement``).
        devices: one device per stage.
        stages: the stages to build (all of them in one process, one per rank).
        make_chunk: ``make_chunk(index, stage, first_layer, layers, device)`` -> chunk.
    """
    built = {}
    for index, (first, layers) in enumerate(slices(model, balance)):
        stage = schedule.placement[index]
        if stage in stages:
            layers.to(devices[stage])
            built[index] = make_chunk(index, stage, first, layers, devices[stage])
    return built
