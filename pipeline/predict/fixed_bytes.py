"""What a pipeline stage holds throughout a step beside activations: parameters, their
gradients, the optimizer's state and its transport's receive buffers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from schedules import Schedule
from schedules.dependencies import crossings

from pipeline.compute.chunk import ChunkRunner
from pipeline.payloads.values import crossing
from pipeline.predict.probe import ChunkCosts
from pipeline.runtime.runner import Runner


@crossing
@dataclass(frozen=True)
class FixedBytes:
    """What a stage holds throughout a step, beside activations.

    Attributes:
        parameters: bytes of its parameters (a parameter its chunks share counted once).
        gradients: bytes of the gradients of those that require grad.
        optimizer: bytes of the optimizer's state for them (0 without an optimizer).
        buffers: receive buffers its transport keeps for incoming payloads.
    """

    parameters: int
    gradients: int
    optimizer: int
    buffers: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.buffers


def fixed_bytes(runner: Runner, optimizer: torch.optim.Optimizer | None,
                measured: dict[int, ChunkCosts]) -> dict[int, FixedBytes]:
    """Per local stage: parameters, gradients, optimizer state and receive buffers."""
    schedule: Schedule = runner.schedule
    by_stage: dict[int, list[ChunkRunner]] = {}
    for index, chunk in runner.chunks.items():
        by_stage.setdefault(schedule.placement[index], []).append(chunk)
    found = {}
    for stage, chunks in by_stage.items():
        parameters = list(dict.fromkeys(p for c in chunks for p in c.layers.parameters()))
        found[stage] = FixedBytes(
            parameters=sum(_nbytes(p) for p in parameters),
            gradients=sum(_nbytes(p) for p in parameters if p.requires_grad),
            optimizer=optimizer_state_bytes(optimizer, parameters),
            buffers=_receive_buffers(runner, stage, measured),
        )
    return found


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


_STATE_PER_PARAMETER = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2,
                        "Adagrad": 1, "Adadelta": 2, "RMSprop": 1, "SGD": 0}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None,
                          parameters: Sequence[torch.Tensor]) -> int:
    """Bytes of the optimizer's state for ``parameters`` once it has stepped.

    The state it already holds is counted as it is; otherwise the usual state per
    parameter of torch's optimizers: Adam-like two tensors (three with amsgrad),
    RMSprop one (two centred, one more with momentum), SGD one with momentum.
    """
    if optimizer is None:
        return 0
    wanted = {id(p) for p in parameters}
    total = 0
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if id(parameter) not in wanted or not parameter.requires_grad:
                continue
            state = optimizer.state.get(parameter)
            if state:
                total += sum(_nbytes(v) for v in state.values()
                             if isinstance(v, torch.Tensor) and v.dim() > 0)
                continue
            copies = _STATE_PER_PARAMETER.get(type(optimizer).__name__, 0)
            copies += int(bool(group.get("amsgrad"))) + int(bool(group.get("centered")))
            copies += int(bool(group.get("momentum")))
            total += copies * _nbytes(parameter)
    return total


def _receive_buffers(runner: Runner, stage: int, measured: dict[int, ChunkCosts]) -> int:
    """Receive buffers of the stage's transport: the receives it posts ahead (gloo), one per
    posted receive under NCCL's rules, none between threads (payloads are handed over)."""
    transport = getattr(runner, "transport", None)
    if transport is None:
        return 0
    schedule: Schedule = runner.schedule
    incoming = []
    crossing = {chunk for chunk, _, _ in crossings(schedule.placement)}
    for c in schedule.chunks_of_stage[stage]:
        if c in measured and c - 1 in crossing:
            incoming.append(measured[c].input_bytes)  # activations in
        if c in measured and c in crossing:
            incoming.append(measured[c].output_bytes)  # gradients back, the output's size
    ahead = int(getattr(transport, "lookahead", 1))
    largest = ahead * max(incoming, default=0)
    budget = int(getattr(transport, "ahead_bytes", 0))  # small messages: all posted at once
    return max(largest, min(budget, schedule.microbatches * sum(incoming)))
