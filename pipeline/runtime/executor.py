"""Run one stage's part of a comm plan against a transport and record what happened as Events."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from schedules import Event, Group, Schedule
from schedules.action import CODE_B, CODE_F, CODE_W, OPS
from schedules.dependencies import ActionKey
from schedules.plan_steps import GROUP_STEP

from pipeline.compute.chunk import ChunkRunner
from pipeline.compute.microbatch import to_device
from pipeline.runtime.loss_carrier import LossCarrier
from pipeline.runtime.paired import run_pair
from pipeline.runtime.stage_steps import NO_SOURCE, StageSteps
from pipeline.transports.base import Payload, Transport


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
    The steps are read from the plan's arrays (``StageSteps``); an action's ``Action``
    (for its event) and a group's ``Group`` (for the transport) are made as they run.
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
    _run_steps(run)
    if run.carrier is not None:
        run.result.loss_known = run.carrier.known
    if meter is not None:
        meter.compute += sum(event.end - event.start for event in run.result.events)
    return run.result


def _run_steps(run: _StageRun) -> None:
    """Each step of the stage's plan in order: a group posted, an action (or an overlapped
    pair of them, ``schedules.pairs``) computed."""
    plan = run.plan
    steps = plan.steps
    kinds, slots, codes = steps.kinds, steps.slots, steps.actions.ops
    pairs = () if run.infer else frozenset(plan.comm.schedule.pairs[plan.stage])
    paired = False
    for at in range(len(kinds)):
        slot = slots[at]
        if kinds[at] == GROUP_STEP:
            _post(run, steps.group(slot))
            continue
        if paired:  # the backward of the pair just run
            paired = False
            continue
        code = codes[slot]
        if slot in pairs:
            _pair(run, slot, codes[slot + 1])
            paired = True
        elif code == CODE_F:
            _forward(run, slot)
        elif code == CODE_W:
            _weight(run, slot)
        else:
            _backward(run, slot, code)


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


def _fetch(run: _StageRun, slot: int, microbatch: int) -> Payload:
    """The result action ``slot`` starts from: kept on this stage, or taken from a peer."""
    plan = run.plan
    key = (OPS[plan.source_ops[slot]], microbatch, plan.source_chunks[slot])
    if plan.source_here[slot]:
        return run.kept.pop(key)
    return run.take(key)


def _deliver(run: _StageRun, slot: int, code: int, microbatch: int, chunk: int,
             produced: Payload) -> None:
    """Where an action's result goes: to a peer (a backward's with the loss row, when the
    step carries the loss), to a later chunk of this stage, or both."""
    plan = run.plan
    key = (OPS[code], microbatch, chunk)
    if plan.sent[slot]:
        carrier = run.carrier
        run.outgoing[key] = produced if carrier is None or code == CODE_F \
            else carrier.attach(produced)
    if plan.kept[slot]:
        run.kept[key] = produced


def _post(run: _StageRun, group: Group) -> None:
    outgoing = run.outgoing
    run.post(group, {op.key: outgoing.pop(op.key) for op in group.ops if op.kind == "send"})


def _pair(run: _StageRun, slot: int, backward_code: int) -> None:
    """The forward at ``slot`` and the backward after it as one overlapped pair
    (``pipeline.runtime.paired``): both inputs fetched first, both results delivered after.
    Their events split the pair's interval by the time each computed, forward first."""
    forward = _forward_call(run, slot)
    backward = _backward_call(run, slot + 1, backward_code)
    start = run.clock()
    forward_done, backward_done, forward_time = run_pair(forward, backward)
    end = run.clock()
    actions = run.plan.steps.actions
    middle = min(end, start + forward_time)
    run.events.append(Event(run.plan.stage, actions[slot], start, middle))
    run.events.append(Event(run.plan.stage, actions[slot + 1], middle, end))
    forward_done()
    backward_done()


def _forward(run: _StageRun, slot: int) -> None:
    actions = run.plan.steps.actions
    if run.infer:
        microbatch, index = actions.microbatches[slot], actions.chunks[slot]
        chunk = run.chunks[index]
        if run.plan.source_ops[slot] == NO_SOURCE:
            inputs = run.step_inputs.inputs[microbatch]  # type: ignore[index]
        else:
            inputs = _fetch(run, slot, microbatch)
        start = run.clock()
        produced = chunk.infer(microbatch, inputs)
        run.events.append(Event(run.plan.stage, actions[slot], start, run.clock()))
        if chunk.spec.is_last:
            run.result.outputs[microbatch] = produced
        else:
            _deliver(run, slot, CODE_F, microbatch, index, produced)
        return
    compute = _forward_call(run, slot)
    start = run.clock()
    deliver = compute()
    run.events.append(Event(run.plan.stage, actions[slot], start, run.clock()))
    deliver()


def _forward_call(run: _StageRun, slot: int) -> Callable[[], Callable[[], None]]:
    """A training forward with its input fetched now: a call that computes it and returns
    the call that delivers its result."""
    actions = run.plan.steps.actions
    microbatch, index = actions.microbatches[slot], actions.chunks[slot]
    chunk = run.chunks[index]
    is_last = chunk.spec.is_last
    if run.plan.source_ops[slot] == NO_SOURCE:
        inputs = run.step_inputs.inputs[microbatch]  # type: ignore[index]
    else:
        inputs = _fetch(run, slot, microbatch)
    target = run.step_inputs.targets[microbatch] if is_last else None  # type: ignore[index]
    weight = run.step_inputs.weights[microbatch]

    def compute() -> Callable[[], None]:
        produced = chunk.forward(microbatch, inputs, target, weight)

        def deliver() -> None:
            if is_last:
                run.result.losses[microbatch] = produced
                if run.carrier is not None:
                    run.carrier.add(produced)
            else:
                _deliver(run, slot, CODE_F, microbatch, index, produced)
        return deliver
    return compute


def _backward(run: _StageRun, slot: int, code: int) -> None:
    compute = _backward_call(run, slot, code)
    start = run.clock()
    deliver = compute()
    run.events.append(Event(run.plan.stage, run.plan.steps.actions[slot], start, run.clock()))
    deliver()


def _backward_call(run: _StageRun, slot: int, code: int) -> Callable[[], Callable[[], None]]:
    """A backward (``B`` or ``I``) with its gradients fetched now: a call that computes it
    and returns the call that delivers its result."""
    plan = run.plan
    actions = plan.steps.actions
    microbatch, index = actions.microbatches[slot], actions.chunks[slot]
    chunk = run.chunks[index]
    grads = None  # the last chunk's: the loss is the root
    if plan.source_ops[slot] != NO_SOURCE:
        grads = _fetch(run, slot, microbatch)
        if not plan.source_here[slot] and run.carrier is not None:
            grads = run.carrier.detach(grads)

    def compute() -> Callable[[], None]:
        if code == CODE_B:
            produced = chunk.backward(microbatch, grads)
        else:
            produced = chunk.backward_input(microbatch, grads)

        def deliver() -> None:
            if not chunk.spec.is_first:
                _deliver(run, slot, code, microbatch, index, produced)
            elif any(grad is not None for grad in produced):
                run.result.input_grads[microbatch] = produced
        return deliver
    return compute


def _weight(run: _StageRun, slot: int) -> None:
    actions = run.plan.steps.actions
    microbatch = actions.microbatches[slot]
    start = run.clock()
    run.chunks[actions.chunks[slot]].backward_weight(microbatch)
    run.events.append(Event(run.plan.stage, actions[slot], start, run.clock()))
