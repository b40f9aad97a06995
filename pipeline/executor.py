"""Run one stage's action list against a transport and record what happened as Events."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from schedules import Action, Event, Op, Schedule, dependencies, transfers
from schedules.dependencies import ActionKey

from pipeline.stage import ChunkRunner

Payload = Any  # any pytree of tensors (see pipeline.payload)


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

    inputs: Sequence[Payload] | None
    targets: Sequence[Any] | None
    weights: Sequence[float]


@dataclass
class StageResult:
    """What a stage reports after a step: its events, the losses it computed, and the
    gradients with respect to the first chunk's inputs (when ``x`` requires grad)."""

    events: list[Event] = field(default_factory=list)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    input_grads: dict[int, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


Clock = Callable[[], float]


def run_stage(
    schedule: Schedule,
    plan: StagePlan,
    chunks: dict[int, ChunkRunner],
    transport: Transport,
    step_inputs: StepInputs,
    clock: Clock = time.perf_counter,
) -> StageResult:
    """Execute ``plan.actions`` in order; results cross stages through ``transport``.

    An action's event spans its compute only: waiting for an input counts as idle.

    Raises:
        ValueError: this stage runs the first chunk without ``x``, or the last without targets.
    """
    owned = {action.chunk for action in plan.actions}
    if 0 in owned and step_inputs.inputs is None:
        raise ValueError(f"stage {plan.stage} runs the first chunk and needs the input x")
    if schedule.chunks - 1 in owned and step_inputs.targets is None:
        raise ValueError(f"stage {plan.stage} runs the last chunk and needs the target")
    run = _StageRun(schedule, plan, chunks, transport, step_inputs)
    for action in plan.actions:
        if action.op is Op.F:
            inputs, target = run.forward_inputs(action)
            start = clock()
            produced = run.forward(action, inputs, target)
        elif action.op is Op.W:
            start = clock()
            produced = chunks[action.chunk].backward_weight(action.microbatch)
        else:
            grads = run.output_grads(action)
            start = clock()
            produced = run.backward(action, grads)
        run.result.events.append(Event(plan.stage, action, start, clock()))
        if produced is not None:
            run.deliver(action, produced)
    return run.result


@dataclass
class _StageRun:
    """One stage's state during a step: results kept for its own later chunks, losses, events."""

    schedule: Schedule
    plan: StagePlan
    chunks: dict[int, ChunkRunner]
    transport: Transport
    step_inputs: StepInputs
    result: StageResult = field(default_factory=StageResult)
    kept: dict[ActionKey, Payload] = field(default_factory=dict)

    def fetch(self, key: ActionKey) -> Payload:
        if key in self.kept:
            return self.kept.pop(key)
        return self.transport.receive(key, self.plan.sources[key])

    def deliver(self, action: Action, produced: Payload) -> None:
        key = _key(action)
        for destination in self.plan.destinations.get(key, ()):
            self.transport.send(key, destination, produced)
        if key in self.plan.kept:
            self.kept[key] = produced

    def forward_inputs(self, action: Action) -> tuple[Payload, Any]:
        microbatch, chunk = action.microbatch, action.chunk
        if chunk == 0:
            inputs = self.step_inputs.inputs[microbatch]  # type: ignore[index]
        else:
            inputs = self.fetch((Op.F, microbatch, chunk - 1))
        is_last = chunk == self.schedule.chunks - 1
        target = self.step_inputs.targets[microbatch] if is_last else None  # type: ignore[index]
        return inputs, target

    def forward(self, action: Action, inputs: Payload, target: Any) -> Payload:
        microbatch = action.microbatch
        weight = self.step_inputs.weights[microbatch]
        produced = self.chunks[action.chunk].forward(microbatch, inputs, target, weight)
        if action.chunk == self.schedule.chunks - 1:
            self.result.losses[microbatch] = produced
            return None
        return produced

    def output_grads(self, action: Action) -> Payload:
        microbatch, chunk = action.microbatch, action.chunk
        if chunk == self.schedule.chunks - 1:
            return None  # the loss is the root
        later = self.schedule.backward_op(microbatch, chunk + 1)
        return self.fetch((later, microbatch, chunk + 1))

    def backward(self, action: Action, grads: Payload) -> Payload:
        chunk = self.chunks[action.chunk]
        if action.op is Op.B:
            produced = chunk.backward(action.microbatch, grads)
        else:
            produced = chunk.backward_input(action.microbatch, grads)
        if action.chunk > 0:
            return produced
        if any(grad is not None for grad in produced):
            self.result.input_grads[action.microbatch] = produced
        return None


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
    chunks: dict[int, ChunkRunner],
    transport: Transport,
    inputs: Sequence[Payload] | None,
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
