"""What a pipeline stage holds throughout a step beside activations: parameters, their
gradients, the optimizer's state and its transport's receive buffers.

Bytes are this rank's own: a parameter sharded by FSDP2 (a DTensor) counts its local
shard, and so do its gradient and the optimizer's state for it. A sharded stage also
holds, within a step, its parameters whole (gathered; with ``reshard_after_forward``
only the shard groups in use, ``partitioners.cut.memory.gathered_bytes``) and their gradients
whole, which accumulate unsharded until the step's one reduce-scatter (the runner's
``Sharding``). Whole copies (``"replicate"``) hold what a stage alone does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from schedules import Schedule
from schedules.dependencies import crossings

from partitioners.cut.memory import gathered_bytes
from pipeline.compute.chunk import ChunkRunner
from pipeline.payloads.values import crossing
from pipeline.predict.probe import ChunkCosts
from pipeline.runtime.data_parallel import NOT_SHARDED, Sharding, local_part
from pipeline.runtime.runner import Runner


@crossing
@dataclass(frozen=True)
class FixedBytes:
    """What a stage holds throughout a step, beside activations.

    Attributes:
        parameters: bytes of its parameters (a parameter its chunks share counted once;
            this rank's shard of a sharded one).
        gradients: bytes of the gradients of those that require grad (sharded alike).
        optimizer: bytes of the optimizer's state for them (0 without an optimizer;
            sharded alike).
        buffers: receive buffers its transport keeps for incoming payloads.
        gathered: sharded stages: bytes of whole parameters gathered at once in a step.
        unsharded_gradients: sharded stages: bytes of the whole gradients a step
            accumulates before reducing them to the shards.
    """

    parameters: int
    gradients: int
    optimizer: int
    buffers: int
    gathered: int = 0
    unsharded_gradients: int = 0

    @property
    def total(self) -> int:
        """Bytes held throughout a step."""
        return self.between_steps + self.buffers + self.gathered + self.unsharded_gradients

    @property
    def between_steps(self) -> int:
        """Parameters, gradients and optimizer state: what the stage keeps between steps."""
        return self.parameters + self.gradients + self.optimizer


def fixed_bytes(runner: Runner, optimizer: torch.optim.Optimizer | None,
                measured: dict[int, ChunkCosts]) -> dict[int, FixedBytes]:
    """Per local stage: parameters, gradients, optimizer state and receive buffers (this
    rank's shards of them), and what a sharded stage gathers within a step. Read between
    steps (the parameters sharded)."""
    schedule: Schedule = runner.schedule
    sharding: Sharding = getattr(runner, "sharding", NOT_SHARDED)
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
            **_within_step(sharding, parameters, bool(schedule.split_backward)),
        )
    return found


def _within_step(sharding: Sharding, parameters: Sequence[torch.Tensor],
                 split_backward: bool) -> dict[str, int]:
    """A sharded stage's gathered parameters and unsharded gradients (whole sizes); none
    otherwise. The shard groups' element counts take the stage's mean bytes per element."""
    if not (sharding.sharded and sharding.replicas > 1):
        return {}
    elements = sum(p.numel() for p in parameters)
    whole = sum(_whole_bytes(p) for p in parameters)
    per_element = whole / elements if elements else 0.0
    shard_groups = [count * per_element for count in sharding.shard_groups]
    return {
        "gathered": round(gathered_bytes(shard_groups, sharding.reshard_after_forward,
                                         split_backward)),
        "unsharded_gradients": sum(_whole_bytes(p) for p in parameters if p.requires_grad),
    }


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of ``tensor``: a DTensor's local shard, else all of it."""
    return _whole_bytes(local_part(tensor))


def _whole_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the whole tensor (a DTensor's global size)."""
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
