"""Run one stage's action list against a transport and record what happened as Events."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from schedules import Action, Event, Op, Schedule, dependencies, transfers
from schedules.dependencies import ActionKey

from pipeline.microbatch import Tensors
from pipeline.stage import ModelChunk

Payload = Any  # a tensor, or a tuple of tensors


class Transport(Protocol):
    """Moves results between stages. Keys are the producing action's (op, microbatch, chunk)."""

    def send(self, key: ActionKey, destination: int, payload: Payload) -> None: ...

    def receive(self, key: ActionKey, source: int) -> Payload: ...


@dataclass(frozen=True)
class StagePlan:
    """One stage's part of a schedule: its actions, and which results cross to or from it.

    Derived from ``schedules.transfers``, the single place that turns a schedule
    into sends and receives.
    """

    stage: int
    actions: tuple[Action, ...]
    sources: dict[ActionKey, int]  # a result this stage receives -> the stage sending it
    destinations: dict[ActionKey, tuple[int, ...]]  # a result this stage sends -> stages
    kept: frozenset[ActionKey]  # results consumed by a later chunk on this same stage

    @classmethod
    def of(cls, schedule: Schedule, stage: int) -> StagePlan:
        sources: dict[ActionKey, int] = {}
        destinations: dict[ActionKey, list[int]] = {}
        for transfer in transfers(schedule):
            key = _key(transfer.producer)
            if transfer.destination == stage:
                sources[key] = transfer.source
            if transfer.source == stage:
                destinations.setdefault(key, []).append(transfer.destination)
        kept = set()
        for action in schedule.order[stage]:
            for consumer_chunk in _consumer_chunks(schedule, action):
                if schedule.placement[consumer_chunk] == stage:
                    kept.add(_key(action))
        return cls(
            stage=stage,
            actions=schedule.order[stage],
            sources=sources,
            destinations={k: tuple(v) for k, v in destinations.items()},
            kept=frozenset(kept),
        )

    def receive_order(self, schedule: Schedule) -> list[tuple[ActionKey, int]]:
        """The results this stage receives, in the order its actions consume them."""
        order = []
        for action in self.actions:
            for needed in dependencies(schedule, action):
                key = _key(needed)
                if key in self.sources:
                    order.append((key, self.sources[key]))
        return order


def _key(action: Action) -> ActionKey:
    return (action.op, action.microbatch, action.chunk)


def _consumer_chunks(schedule: Schedule, action: Action) -> tuple[int, ...]:
    if action.op is Op.F and action.chunk < schedule.chunks - 1:
        return (action.chunk + 1,)
    if action.op in (Op.B, Op.I) and action.chunk > 0:
        return (action.chunk - 1,)
    return ()


@dataclass
class StepInputs:
    """What a stage needs from the caller: inputs for chunk 0, targets for the last chunk."""

    inputs: Sequence[Tensors] | None
    targets: Sequence[Any] | None
    weights: Sequence[float]


@dataclass
class StageResult:
    """What a stage reports after a step: its events and the losses it computed."""

    events: list[Event] = field(default_factory=list)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)


Clock = Callable[[], float]


def run_stage(
    schedule: Schedule,
    plan: StagePlan,
    chunks: dict[int, ModelChunk],
    transport: Transport,
    step_inputs: StepInputs,
    clock: Clock = time.perf_counter,
    before_action: Callable[[Action], None] | None = None,
) -> StageResult:
    """Execute ``plan.actions`` in order; results cross stages through ``transport``.

    An action's event spans its compute only: waiting for an input counts as idle.
    """
    result = StageResult()
    local: dict[ActionKey, Payload] = {}
    last_chunk = schedule.chunks - 1

    def fetch(key: ActionKey) -> Payload:
        if key in local:
            return local.pop(key)
        return transport.receive(key, plan.sources[key])

    for action in plan.actions:
        if before_action is not None:
            before_action(action)
        op, microbatch, chunk_index = action.op, action.microbatch, action.chunk
        chunk = chunks[chunk_index]
        key = _key(action)
        produced: Payload = None
        if op is Op.F:
            if chunk_index == 0:
                if step_inputs.inputs is None:
                    raise ValueError(f"stage {plan.stage} runs the first chunk and needs the input x")
                inputs = step_inputs.inputs[microbatch]
            else:
                inputs = fetch((Op.F, microbatch, chunk_index - 1))
            target = None
            if chunk_index == last_chunk:
                if step_inputs.targets is None:
                    raise ValueError(
                        f"stage {plan.stage} runs the last chunk and needs the target"
                    )
                target = step_inputs.targets[microbatch]
            start = clock()
            produced = chunk.forward(microbatch, inputs, target, step_inputs.weights[microbatch])
            end = clock()
            if chunk_index == last_chunk:
                result.losses[microbatch] = produced
                produced = None
        elif op is Op.W:
            start = clock()
            chunk.backward_weight(microbatch)
            end = clock()
        else:
            grads = None
            if chunk_index < last_chunk:
                later = schedule.backward_op(microbatch, chunk_index + 1)
                grads = fetch((later, microbatch, chunk_index + 1))
            start = clock()
            if op is Op.B:
                produced = chunk.backward(microbatch, grads)
            else:
                produced = chunk.backward_input(microbatch, grads)
            end = clock()
            if chunk_index == 0:
                produced = None
        result.events.append(Event(plan.stage, action, start, end))
        if produced is not None:
            for destination in plan.destinations.get(key, ()):
                transport.send(key, destination, produced)
            if key in plan.kept:
                local[key] = produced
    return result


def forward_order(schedule: Schedule, stage: int) -> tuple[Action, ...]:
    """The forwards alone, for inference: chunk by chunk, each over every micro-batch.

    A chunk's inputs come only from lower chunks, so this order cannot deadlock.
    """
    return tuple(
        Action(Op.F, microbatch, chunk)
        for chunk in schedule.chunks_of_stage[stage]
        for microbatch in range(schedule.microbatches)
    )


def run_forward_stage(
    schedule: Schedule,
    plan: StagePlan,
    chunks: dict[int, ModelChunk],
    transport: Transport,
    inputs: Sequence[Tensors] | None,
) -> dict[int, Payload]:
    """Run this stage's forwards for inference; return the last chunk's outputs by micro-batch."""
    local: dict[ActionKey, Payload] = {}
    outputs: dict[int, Payload] = {}
    last_chunk = schedule.chunks - 1
    for action in forward_order(schedule, plan.stage):
        microbatch, chunk_index = action.microbatch, action.chunk
        if chunk_index == 0:
            if inputs is None:
                raise ValueError(f"stage {plan.stage} runs the first chunk and needs the input x")
            value = inputs[microbatch]
        else:
            previous = (Op.F, microbatch, chunk_index - 1)
            value = local.pop(previous) if previous in local else transport.receive(
                previous, plan.sources[previous]
            )
        produced = chunks[chunk_index].infer(microbatch, value)
        key = _key(action)
        if chunk_index == last_chunk:
            outputs[microbatch] = produced
            continue
        for destination in plan.destinations.get(key, ()):
            transport.send(key, destination, produced)
        if key in plan.kept:
            local[key] = produced
    return outputs
