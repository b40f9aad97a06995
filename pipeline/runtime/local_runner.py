"""Run a schedule in one process: one thread per stage, each on its own device."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from schedules import Event, Schedule, Timeline

from pipeline.compute.activations import ActivationTracker, MemoryReport
from pipeline.compute.slicing import build_chunks
from pipeline.runtime.context import CallerState
from pipeline.runtime.data_parallel import NOT_SHARDED, Alone, DataParallel
from pipeline.runtime.executor import StageResult, StepInputs, run_stage
from pipeline.runtime.one_call import STAGE_THREAD_PREFIX
from pipeline.runtime.runner import (
    RECENT_STEPS,
    Plans,
    PendingTimeline,
    measured_timeline,
    propagate_input_grads,
    step_of,
)
from pipeline.compute.chunk import ChunkOptions, ChunkRunner, ChunkSpec
from pipeline.compute.shared import chunk_layers, shared_parameters
from pipeline.compute.tied_hooks import SharedGrads, chunk_users
from pipeline.errors import PipelineAborted
from pipeline.runtime.step_state import StepState
from pipeline.transports.threads import LocalTransport


class LocalRunner:
    """Stages as threads of this process; results cross through a LocalTransport."""

    boundaries = None  # no tensor parallelism in one process
    exchange = None  # nor expert parallelism

    def __init__(
        self,
        model: nn.Sequential,
        balance: Sequence[int],
        schedule: Schedule,
        devices: Sequence[torch.device],
        options: ChunkOptions,
        timeout: float,
    ) -> None:
        self.model = model
        self.local_layers = list(range(len(model)))
        self.schedule = schedule
        self.devices = list(devices)
        self.timeout = timeout
        self.trackers = tuple(
            ActivationTracker(
                (p for c in schedule.chunks_of_stage[s] for p in _chunk_params(model, balance, c)),
                1.0 / len(schedule.chunks_of_stage[s]),
            )
            for s in range(schedule.stages)
        )
        locks = {device: threading.Lock() for device in set(self.devices)}
        # Chunks using a parameter that another chunk uses too accumulate its gradient
        # under one lock: two stage threads may reach it at the same moment.
        shared_layers = {layer for shared in shared_parameters(model).values()
                         for layer in shared.layers}
        self.shared_grads = SharedGrads(chunk_users(model, balance, range(schedule.chunks)))
        layers_of = chunk_layers(balance)

        def make_chunk(spec: ChunkSpec, layers: nn.Sequential, device: torch.device
                       ) -> ChunkRunner:
            shares = any(layer in shared_layers for layer in layers_of[spec.index])
            return ChunkRunner(spec, layers, device, options, self.trackers[spec.stage],
                               locks[device], self.shared_grads if shares else None)

        self.chunks = build_chunks(
            model, balance, schedule, self.devices, range(schedule.stages), make_chunk
        )
        self.plans = Plans(schedule)
        # torch declares no types for Stream's constructor.
        self.streams = [
            torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            if device.type == "cuda" else None for device in self.devices
        ]
        self.memory: tuple[MemoryReport, ...] = ()
        self.sharding = NOT_SHARDED
        self.data_parallel: DataParallel = Alone()  # one process: no replicas
        self._recent: collections.deque[Timeline] = collections.deque(maxlen=RECENT_STEPS)

    def _stage_chunks(self, stage: int) -> dict[int, ChunkRunner]:
        return {c: self.chunks[c] for c in self.schedule.chunks_of_stage[stage]}

    def _run_threads(self, work: Callable[[int, Any], Any], caller: CallerState) -> list[Any]:
        transport = LocalTransport(self.devices, self.timeout)
        results: list[Any] = [None] * self.schedule.stages
        errors: list[tuple[int, BaseException]] = []

        began = [threading.Event() for _ in range(self.schedule.stages)]
        finished = [threading.Event() for _ in range(self.schedule.stages)]

        def worker(stage: int) -> None:
            began[stage].set()
            try:
                if transport.aborted:
                    return  # the caller was interrupted before this thread ran: touch nothing
                with ExitStack() as stack:
                    stack.enter_context(caller.applied())
                    if self.streams[stage] is not None:
                        stack.enter_context(torch.cuda.device(self.devices[stage]))
                        stack.enter_context(torch.cuda.stream(self.streams[stage]))
                    results[stage] = work(stage, transport.endpoint(stage))
            except BaseException as error:  # reported to the caller below
                errors.append((stage, error))
                transport.abort(f"stage {stage} failed: {type(error).__name__}: {error}")
            finally:
                finished[stage].set()

        # Daemons: a stage thread never holds up the interpreter's exit, whatever a second
        # Ctrl-C interrupts; the events say when each stage's work is done.
        threads = [
            threading.Thread(target=worker, args=(stage,), name=f"{STAGE_THREAD_PREFIX}{stage}",
                             daemon=True)
            for stage in range(self.schedule.stages)
        ]
        try:
            for thread in threads:
                thread.start()
            # Events, not Thread.join: a KeyboardInterrupt inside join can leave the thread's
            # lock taken, and the next join waits forever.
            for event in finished:
                event.wait()
        except BaseException:
            # Ctrl-C while the stages start or run: each stops at its next wait, and the
            # step's state is restored only once none of them can write to it any more. A
            # stage whose thread has not begun by now (Ctrl-C between two starts) never will
            # work: it finds the transport aborted.
            transport.abort("interrupted: the caller stopped the step")
            for stage in range(self.schedule.stages):
                if began[stage].is_set():
                    finished[stage].wait()
            raise
        if errors:
            root = [e for e in errors if not isinstance(e[1], PipelineAborted)] or errors
            raise root[0][1]
        for stream in self.streams:
            if stream is not None:
                stream.synchronize()
        return results

    def run_step(
        self, inputs: list[Any] | None, targets: list[Any] | None, weights: list[float] | None
    ) -> tuple[torch.Tensor, PendingTimeline]:
        state = StepState.set_aside(self.parameters(), [self.model])
        self.shared_grads.begin_step()
        try:
            found = self._step(inputs, targets, weights)
        except BaseException as error:
            self.shared_grads.end_step(succeeded=False)
            state.restore(error)
            raise
        self.shared_grads.end_step(succeeded=True)
        state.merge()
        return found

    def _step(
        self, inputs: list[Any] | None, targets: list[Any] | None, weights: list[float] | None
    ) -> tuple[torch.Tensor, PendingTimeline]:
        schedule = self.schedule
        caller = replace(CallerState.capture(), grad_enabled=True)
        for tracker in self.trackers:
            if tracker.measuring:
                tracker.reset_peaks()
        last_device = self.devices[schedule.placement[-1]]
        step_inputs = StepInputs.on(inputs, targets, weights, schedule,
                                    self.devices[schedule.placement[0]], last_device)
        origin = time.perf_counter()
        plans = [self.plans.stage(stage, infer=False) for stage in range(schedule.stages)]

        def work(stage: int, endpoint: Any) -> StageResult:
            endpoint.begin_step(self.plans.training, stage)
            return run_stage(plans[stage], self._stage_chunks(stage), endpoint, step_inputs)

        with step_of(self.chunks.values(), schedule):
            results = self._run_threads(work, caller)
        propagate_input_grads(step_inputs.inputs, results)
        losses = {m: loss for r in results for m, loss in r.losses.items()}
        loss = sum(losses[m].to(last_device) for m in range(schedule.microbatches))
        events = [
            Event(e.stage, e.action, e.start - origin, e.end - origin)
            for r in results for e in r.events
        ]
        if self.trackers[0].measuring:
            self.memory = tuple(t.report() for t in self.trackers)
        timeline = measured_timeline(schedule, events, "measured")
        self._recent.append(timeline)
        return loss, PendingTimeline.ready(timeline)

    def recent_timelines(self) -> tuple[Timeline, ...]:
        """The last ``RECENT_STEPS`` steps' Timelines, oldest first (whole: one process)."""
        return tuple(self._recent)

    def run_forward(self, inputs: list[Any] | None) -> list[Any]:
        schedule = self.schedule
        caller = CallerState.capture()
        step_inputs = StepInputs.on(inputs, None, None, schedule,
                                    self.devices[schedule.placement[0]], None)
        plans = [self.plans.stage(stage, infer=True) for stage in range(schedule.stages)]

        def work(stage: int, endpoint: Any) -> StageResult:
            endpoint.begin_step(self.plans.forward, stage)
            return run_stage(plans[stage], self._stage_chunks(stage), endpoint, step_inputs,
                             infer=True)

        with step_of(self.chunks.values(), schedule):
            results = self._run_threads(work, caller)
        outputs = {m: out for r in results for m, out in r.outputs.items()}
        return [outputs[m] for m in range(schedule.microbatches)]

    # -- the model's state, all of it in this process ----------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), max_norm, norm_type)

    def release(self) -> None:
        """Nothing outlives a step here: its threads end with it."""

    def close(self) -> None:
        for stream in self.streams:
            if stream is not None:
                stream.synchronize()
        for chunk in self.chunks.values():
            chunk.close()


def _chunk_params(model: nn.Sequential, balance: Sequence[int], chunk: int) -> list[torch.Tensor]:
    return [p for i in chunk_layers(balance)[chunk] for p in model[i].parameters()]
