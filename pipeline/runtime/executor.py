"""Run one stage's part of a comm plan against a transport and record what happened as Events."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from schedules import Action, CommPlan, Event, Group, Op, Schedule
from schedules.dependencies import ActionKey, received

from pipeline.compute.chunk import ChunkRunner
from pipeline.compute.microbatch import to_device
from pipeline.runtime.loss_carrier import LossCarrier
from pipeline.transports.base import Payload, Transport


@dataclass(frozen=True)
class StageSteps:
    """One stage's part of a comm plan: its steps, and which results it sends or keeps.

    Derived from ``schedules.comm_plan``, the single place that turns a schedule
    into sends and receives.
    """

    stage: int
    schedule: Schedule
    steps: tuple[Action | Group, ...]
    sent: frozenset[ActionKey]  # results sent to another stage
    kept: frozenset[ActionKey]  # results consumed by a later chunk on this same stage
    # per action of the stage: the result it starts from (``dependencies.received``)
    sources: dict[ActionKey, ActionKey | None] = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, comm: CommPlan, stage: int) -> StageSteps:
        schedule = comm.schedule
        sources = {_key(action): received(schedule, action) for action in schedule.order[stage]}
        kept = {source for source in sources.values()
                if source is not None and schedule.placement[source[2]] == stage}
        return cls(
            stage=stage,
            schedule=schedule,
            steps=tuple(comm.stages[stage]),  # materialised once: iterated every step
            sent=frozenset(op.key for op in comm.sends(stage)),
            kept=frozenset(kept),
            sources=sources,
        )

    @property
    def actions(self) -> tuple[Action, ...]:
        return self.schedule.order[self.stage]

    @cached_property
    def owned(self) -> frozenset[int]:
        return frozenset(action.chunk for action in self.actions)

    def compiled(self, infer: bool) -> tuple[Operation, ...]:
        """The steps as prepared operations (``compile_plan``), compiled once per mode."""
        cache = self.__dict__.setdefault("_compiled", {})
        if infer not in cache:
            cache[infer] = compile_plan(self, infer)
        return cache[infer]  # type: ignore[no-any-return]


def _key(action: Action) -> ActionKey:
    return (action.op, action.microbatch, action.chunk)


@dataclass
class StepInputs:
    """What a stage needs from the caller: inputs for chunk 0, targets for the last chunk,
    and the factor of each micro-batch's loss."""

    inputs: Sequence[Payload] | None
    targets: Sequence[Any] | None
    weights: Sequence[float]

    @classmethod
    def on(cls, inputs: Sequence[Payload] | None, targets: Sequence[Any] | None,
           weights: Sequence[float] | None, schedule: Schedule, first: torch.device,
           last: torch.device | None) -> StepInputs:
        """The caller's micro-batches moved to where they are read: ``inputs`` to ``first``
        (the first chunk's device), ``targets`` to ``last`` (the last chunk's); None stays
        None. ``weights`` None (or empty): each micro-batch's loss weighs an equal share,
        1 / micro-batches (read only where the last chunk runs)."""
        microbatches = schedule.microbatches
        return cls(
            None if inputs is None else to_device(list(inputs), first),
            None if targets is None or last is None else to_device(list(targets), last),
            weights or [1.0 / microbatches] * microbatches,
        )


@dataclass
class StageResult:
    """What a stage reports after a step: its events, the losses it computed, and the
    gradients with respect to the first chunk's inputs (when ``x`` requires grad)."""

    events: list[Event] = field(default_factory=list)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, Payload] = field(default_factory=dict)  # the last chunk's, when inferring
    input_grads: dict[int, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    loss_known: torch.Tensor | None = None  # with ``carry_loss``: see ``LossCarrier``


Clock = Callable[[], float]


@dataclass
class StepMeter:
    """Opt-in accounting of where a stage's step went (off by default: ``meter=None``).

    ``compute``: the actions' own time (their events); ``wait``: inside ``transport.take``
    (waiting for a peer, and unpacking) and the transport's ``finish``; ``post``: inside
    ``transport.post`` (sends) and its ``begin_step`` (the first receives posted);
    ``collective``: the runner's end of the step (the loss, the timeline's gather posted,
    shared and data-parallel gradients); ``total``: the runner's whole
    step. Seconds, summed over ``steps`` steps; ``reset`` starts again.
    """

    compute: float = 0.0
    wait: float = 0.0
    post: float = 0.0
    collective: float = 0.0
    total: float = 0.0
    steps: int = 0

    def reset(self) -> None:
        self.compute = self.wait = self.post = self.collective = self.total = 0.0
        self.steps = 0

    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per step: each part, and ``overhead``, the rest of ``total``."""
        steps = max(1, self.steps)
        parts = {"compute": self.compute, "wait": self.wait, "post": self.post,
                 "collective": self.collective}
        rest = self.total - sum(parts.values())
        return {**{k: 1e3 * v / steps for k, v in parts.items()},
                "overhead": 1e3 * rest / steps, "total": 1e3 * self.total / steps}


def run_stage(
    plan: StageSteps,
    chunks: dict[int, ChunkRunner],
    transport: Transport,
    step_inputs: StepInputs,
    clock: Clock = time.perf_counter,
    infer: bool = False,
    meter: StepMeter | None = None,
    carry_loss: torch.device | None = None,
) -> StageResult:
    """Execute ``plan.steps`` in order: compute actions, and groups posted to ``transport``.

    With ``infer`` (a forward-only plan, for ``Pipe.__call__``) the forwards keep
    nothing for a backward and the last chunk's outputs are returned, not losses.
    An action's event spans its compute only: waiting for an input counts as idle.
    The plan is compiled once (``StageSteps.compiled``) into prepared operations, each
    with what it fetches, runs and delivers resolved; a step only calls them in turn.
    With ``carry_loss`` (this stage's device; every stage of the step must pass it) the
    backward messages carry the batch loss (``LossCarrier``) and ``result.loss_known``
    ends as ``[micro-batches counted, their loss sum]``.

    Raises:
        ValueError: this stage runs the first chunk without ``x``, or the last without targets.
    """
    specs = [chunks[index].spec for index in plan.owned]
    if step_inputs.inputs is None and any(spec.is_first for spec in specs):
        raise ValueError(f"stage {plan.stage} runs the first chunk and needs the input x")
    if not infer and step_inputs.targets is None and any(spec.is_last for spec in specs):
        raise ValueError(f"stage {plan.stage} runs the last chunk and needs the target")
    run = _StageRun(plan, chunks, transport, step_inputs, infer, clock)
    if carry_loss is not None and not infer:
        run.carrier = LossCarrier(carry_loss)
    if meter is not None:
        run.take = _timed(transport.take, meter, "wait")
        run.post = _timed(transport.post, meter, "post")
    for operation in plan.compiled(infer):
        operation(run)
    if run.carrier is not None:
        run.result.loss_known = run.carrier.known
    if meter is not None:
        meter.compute += sum(event.end - event.start for event in run.result.events)
    return run.result


def _timed(function: Callable[..., Any], meter: StepMeter, part: str) -> Callable[..., Any]:
    def timed(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args)
        finally:
            setattr(meter, part, getattr(meter, part) + time.perf_counter() - start)

    return timed


class _StageRun:
    """One stage's state during a step: results kept or waiting to be sent, losses, events."""

    __slots__ = ("plan", "chunks", "transport", "step_inputs", "infer", "clock", "result",
                 "kept", "outgoing", "take", "post", "events", "carrier")

    def __init__(self, plan: StageSteps, chunks: dict[int, ChunkRunner], transport: Transport,
                 step_inputs: StepInputs, infer: bool, clock: Clock) -> None:
        self.plan = plan
        self.chunks = chunks
        self.transport = transport
        self.step_inputs = step_inputs
        self.infer = infer
        self.clock = clock
        self.result = StageResult()
        self.events = self.result.events
        self.kept: dict[ActionKey, Payload] = {}
        self.outgoing: dict[ActionKey, Payload] = {}
        self.take = transport.take
        self.post = transport.post
        self.carrier: LossCarrier | None = None


Operation = Callable[[_StageRun], None]


def _fetcher(key: ActionKey, kept_here: bool) -> Callable[[_StageRun], Payload]:
    """How an action gets a result: from this stage (a later chunk of it) or from a peer."""
    if kept_here:
        return lambda run: run.kept.pop(key)
    return lambda run: run.take(key)


def _deliverer(plan: StageSteps, action: Action) -> Callable[[_StageRun, Payload], None]:
    """Where an action's result goes: to a peer (a backward's with the loss row, when the
    step carries the loss), to a later chunk of this stage, or both."""
    key = _key(action)
    sent, kept = key in plan.sent, key in plan.kept
    backward = action.op is not Op.F

    def deliver(run: _StageRun, produced: Payload) -> None:
        if sent:
            carrier = run.carrier
            run.outgoing[key] = produced if carrier is None or not backward \
                else carrier.attach(produced)
        if kept:
            run.kept[key] = produced

    return deliver


def _compile_group(group: Group) -> Operation:
    sends = tuple(op.key for op in group.ops if op.kind == "send")

    def post(run: _StageRun) -> None:
        outgoing = run.outgoing
        run.post(group, {key: outgoing.pop(key) for key in sends})

    return post


def _compile_forward(plan: StageSteps, action: Action, infer: bool, kept: frozenset[ActionKey]
                     ) -> Operation:
    stage, microbatch, index = plan.stage, action.microbatch, action.chunk
    received_key = plan.sources[_key(action)]
    source = None if received_key is None else _fetcher(received_key, received_key in kept)
    deliver = _deliverer(plan, action)

    def forward(run: _StageRun) -> None:
        chunk = run.chunks[index]
        is_last = chunk.spec.is_last
        if source is None:
            inputs = run.step_inputs.inputs[microbatch]  # type: ignore[index]
        else:
            inputs = source(run)
        if infer:
            start = run.clock()
            produced = chunk.infer(microbatch, inputs)
            run.events.append(Event(stage, action, start, run.clock()))
            if is_last:
                run.result.outputs[microbatch] = produced
            else:
                deliver(run, produced)
            return
        target = run.step_inputs.targets[microbatch] if is_last else None  # type: ignore[index]
        weight = run.step_inputs.weights[microbatch]
        start = run.clock()
        produced = chunk.forward(microbatch, inputs, target, weight)
        run.events.append(Event(stage, action, start, run.clock()))
        if is_last:
            run.result.losses[microbatch] = produced
            if run.carrier is not None:
                run.carrier.add(produced)
        else:
            deliver(run, produced)

    return forward


def _compile_backward(plan: StageSteps, action: Action, kept: frozenset[ActionKey]) -> Operation:
    stage, microbatch, index = plan.stage, action.microbatch, action.chunk
    source = None
    from_peer = False
    later = plan.sources[_key(action)]
    if later is not None:  # else the loss is the root
        from_peer = later not in kept
        source = _fetcher(later, not from_peer)
    split = action.op is not Op.B
    deliver = _deliverer(plan, action)

    def backward(run: _StageRun) -> None:
        chunk = run.chunks[index]
        grads = None if source is None else source(run)
        if from_peer and run.carrier is not None:
            grads = run.carrier.detach(grads)
        start = run.clock()
        if split:
            produced = chunk.backward_input(microbatch, grads)
        else:
            produced = chunk.backward(microbatch, grads)
        run.events.append(Event(stage, action, start, run.clock()))
        if not chunk.spec.is_first:
            deliver(run, produced)
        elif any(grad is not None for grad in produced):
            run.result.input_grads[microbatch] = produced

    return backward


def _compile_weight(plan: StageSteps, action: Action) -> Operation:
    stage, microbatch, index = plan.stage, action.microbatch, action.chunk

    def weight(run: _StageRun) -> None:
        start = run.clock()
        run.chunks[index].backward_weight(microbatch)
        run.events.append(Event(stage, action, start, run.clock()))

    return weight


def compile_plan(plan: StageSteps, infer: bool) -> tuple[Operation, ...]:
    """``plan.steps`` as prepared operations, each a callable of the step's ``_StageRun``."""
    operations: list[Operation] = []
    for step in plan.steps:
        if isinstance(step, Group):
            operations.append(_compile_group(step))
        elif step.op is Op.F:
            operations.append(_compile_forward(plan, step, infer, plan.kept))
        elif step.op is Op.W:
            operations.append(_compile_weight(plan, step))
        else:
            operations.append(_compile_backward(plan, step, plan.kept))
    return tuple(operations)
