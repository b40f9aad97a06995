"""Run one stage's part of a comm plan against a transport and record what happened as Events."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from schedules import Action, CommPlan, Event, Group, Op, Schedule
from schedules.dependencies import ActionKey

from pipeline.stage import ChunkRunner
from pipeline.transports.base import Payload, Transport


@dataclass(frozen=True)
class StagePlan:
    """One stage's part of a comm plan: its steps, and which results it sends or keeps.

    Derived from ``schedules.comm_plan``, the single place that turns a schedule
    into sends and receives.
    """

    stage: int
    schedule: Schedule
    steps: tuple[Action | Group, ...]
    sent: frozenset[ActionKey]  # results sent to another stage
    kept: frozenset[ActionKey]  # results consumed by a later chunk on this same stage

    @classmethod
    def of(cls, comm: CommPlan, stage: int) -> StagePlan:
        schedule = comm.schedule
        kept = set()
        for action in schedule.order[stage]:
            for consumer_chunk in _consumer_chunks(schedule, action):
                if schedule.placement[consumer_chunk] == stage:
                    kept.add(_key(action))
        return cls(
            stage=stage,
            schedule=schedule,
            steps=comm.stages[stage],
            sent=frozenset(op.key for op in comm.sends(stage)),
            kept=frozenset(kept),
        )

    @property
    def actions(self) -> tuple[Action, ...]:
        return self.schedule.order[self.stage]


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
    outputs: dict[int, Payload] = field(default_factory=dict)  # the last chunk's, when inferring
    input_grads: dict[int, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


Clock = Callable[[], float]


def run_stage(
    plan: StagePlan,
    chunks: dict[int, ChunkRunner],
    transport: Transport,
    step_inputs: StepInputs,
    clock: Clock = time.perf_counter,
    infer: bool = False,
) -> StageResult:
    """Execute ``plan.steps`` in order: compute actions, and groups posted to ``transport``.

    With ``infer`` (a forward-only plan, for ``Pipe.__call__``) the forwards keep
    nothing for a backward and the last chunk's outputs are returned, not losses.
    An action's event spans its compute only: waiting for an input counts as idle.

    Raises:
        ValueError: this stage runs the first chunk without ``x``, or the last without targets.
    """
    schedule = plan.schedule
    owned = {action.chunk for action in plan.actions}
    if 0 in owned and step_inputs.inputs is None:
        raise ValueError(f"stage {plan.stage} runs the first chunk and needs the input x")
    if not infer and schedule.chunks - 1 in owned and step_inputs.targets is None:
        raise ValueError(f"stage {plan.stage} runs the last chunk and needs the target")
    run = _StageRun(plan, chunks, transport, step_inputs, infer)
    for step in plan.steps:
        if isinstance(step, Group):
            transport.post(step, {op.key: run.outgoing.pop(op.key)
                                  for op in step.ops if op.kind == "send"})
            continue
        if step.op is Op.F:
            inputs, target = run.forward_inputs(step)
            start = clock()
            produced = run.forward(step, inputs, target)
        elif step.op is Op.W:
            start = clock()
            produced = chunks[step.chunk].backward_weight(step.microbatch)
        else:
            grads = run.output_grads(step)
            start = clock()
            produced = run.backward(step, grads)
        run.result.events.append(Event(plan.stage, step, start, clock()))
        if produced is not None:
            run.deliver(step, produced)
    return run.result


@dataclass
class _StageRun:
    """One stage's state during a step: results kept or waiting to be sent, losses, events."""

    plan: StagePlan
    chunks: dict[int, ChunkRunner]
    transport: Transport
    step_inputs: StepInputs
    infer: bool
    result: StageResult = field(default_factory=StageResult)
    kept: dict[ActionKey, Payload] = field(default_factory=dict)
    outgoing: dict[ActionKey, Payload] = field(default_factory=dict)

    def fetch(self, key: ActionKey) -> Payload:
        if key in self.kept:
            return self.kept.pop(key)
        return self.transport.take(key)

    def deliver(self, action: Action, produced: Payload) -> None:
        key = _key(action)
        if key in self.plan.sent:
            self.outgoing[key] = produced
        if key in self.plan.kept:
            self.kept[key] = produced

    def forward_inputs(self, action: Action) -> tuple[Payload, Any]:
        microbatch, chunk = action.microbatch, action.chunk
        if chunk == 0:
            inputs = self.step_inputs.inputs[microbatch]  # type: ignore[index]
        else:
            inputs = self.fetch((Op.F, microbatch, chunk - 1))
        is_last = chunk == self.plan.schedule.chunks - 1
        target = None
        if is_last and not self.infer:
            target = self.step_inputs.targets[microbatch]  # type: ignore[index]
        return inputs, target

    def forward(self, action: Action, inputs: Payload, target: Any) -> Payload:
        microbatch, chunk = action.microbatch, self.chunks[action.chunk]
        is_last = action.chunk == self.plan.schedule.chunks - 1
        if self.infer:
            produced = chunk.infer(microbatch, inputs)
            if is_last:
                self.result.outputs[microbatch] = produced
                return None
            return produced
        weight = self.step_inputs.weights[microbatch]
        produced = chunk.forward(microbatch, inputs, target, weight)
        if is_last:
            self.result.losses[microbatch] = produced
            return None
        return produced

    def output_grads(self, action: Action) -> Payload:
        microbatch, chunk = action.microbatch, action.chunk
        schedule = self.plan.schedule
        if chunk == schedule.chunks - 1:
            return None  # the loss is the root
        later = schedule.backward_op(microbatch, chunk + 1)
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
