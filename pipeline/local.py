"""Run a schedule in one process: one thread per stage, each on its own device."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from schedules import Schedule, Timeline

from pipeline.checkpoint import step_seed
from pipeline.context import CallerState
from pipeline.executor import StagePlan, StepInputs, run_forward_stage, run_stage
from pipeline.memory import ActivationTracker, MemoryReport
from pipeline.microbatch import to_device
from pipeline.payload import differentiable, flatten
from pipeline.partition import build_chunks
from pipeline.shared import chunk_layers, shared_parameters
from pipeline.stage import ChunkOptions, ChunkRunner, ChunkSpec
from pipeline.transport import LocalTransport, PipelineAborted


class LocalRunner:
    """Stages as threads of this process; results cross through a LocalTransport."""

    def __init__(
        self,
        model: nn.Sequential,
        balance: Sequence[int],
        schedule: Schedule,
        devices: Sequence[torch.device],
        options: ChunkOptions,
        timeout: float,
    ) -> None:
        self.schedule = schedule
        self.devices = list(devices)
        self.timeout = timeout
        self.trackers = [
            ActivationTracker(
                (p for c in schedule.chunks_of_stage[s] for p in _chunk_params(model, balance, c)),
                1.0 / len(schedule.chunks_of_stage[s]),
            )
            for s in range(schedule.stages)
        ]
        locks = {device: threading.Lock() for device in set(self.devices)}
        # Chunks using a parameter that another chunk uses too accumulate its gradient
        # under one lock: two stage threads may reach it at the same moment.
        shared_layers = {layer for shared in shared_parameters(model).values()
                         for layer in shared.layers}
        grad_lock = threading.Lock()
        layers_of = chunk_layers(balance)

        def make_chunk(index: int, stage: int, first: int, layers: nn.Sequential,
                       device: torch.device) -> ChunkRunner:
            spec = ChunkSpec(index, stage, first, index == 0, index == schedule.chunks - 1)
            shares = any(layer in shared_layers for layer in layers_of[index])
            return ChunkRunner(spec, layers, device, options, self.trackers[stage],
                               locks[device], grad_lock if shares else None)

        self.chunks = build_chunks(
            model, balance, schedule, self.devices, range(schedule.stages), make_chunk
        )
        self.plans = [StagePlan.of(schedule, stage) for stage in range(schedule.stages)]
        self.streams = [
            torch.cuda.Stream(device) if device.type == "cuda" else None for device in self.devices
        ]
        self.memory: tuple[MemoryReport, ...] = ()

    def _stage_chunks(self, stage: int) -> dict[int, ChunkRunner]:
        return {c: self.chunks[c] for c in self.schedule.chunks_of_stage[stage]}

    def _run_threads(self, work: Callable[[int, Any], Any], caller: CallerState) -> list[Any]:
        transport = LocalTransport(self.devices, self.timeout)
        results: list[Any] = [None] * self.schedule.stages
        errors: list[tuple[int, BaseException]] = []

        def worker(stage: int) -> None:
            try:
                with ExitStack() as stack:
                    stack.enter_context(caller.applied())
                    if self.streams[stage] is not None:
                        stack.enter_context(torch.cuda.device(self.devices[stage]))
                        stack.enter_context(torch.cuda.stream(self.streams[stage]))
                    results[stage] = work(stage, transport.endpoint(stage))
            except BaseException as error:  # reported to the caller below
                errors.append((stage, error))
                transport.abort(f"stage {stage} failed: {type(error).__name__}: {error}")

        threads = [
            threading.Thread(target=worker, args=(stage,), name=f"pipesched-stage-{stage}")
            for stage in range(self.schedule.stages)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            root = [e for e in errors if not isinstance(e[1], PipelineAborted)] or errors
            raise root[0][1]
        for stream in self.streams:
            if stream is not None:
                stream.synchronize()
        return results

    def run_step(
        self, inputs: list[Any], targets: list[Any], weights: list[float]
    ) -> tuple[torch.Tensor, Timeline]:
        schedule = self.schedule
        caller = CallerState.capture()
        seed = step_seed()
        for chunk in self.chunks.values():
            chunk.begin_step(seed, schedule.microbatches, bool(schedule.split_backward))
        for tracker in self.trackers:
            tracker.reset_peaks()
        first_device = self.devices[schedule.placement[0]]
        last_device = self.devices[schedule.placement[-1]]
        step_inputs = StepInputs(
            inputs=[to_device(x, first_device) for x in inputs],
            targets=[to_device(t, last_device) for t in targets],
            weights=weights,
        )
        origin = time.perf_counter()

        def work(stage: int, endpoint: Any) -> Any:
            return run_stage(schedule, self.plans[stage], self._stage_chunks(stage), endpoint,
                             step_inputs)

        try:
            results = self._run_threads(work, replace(caller, grad_enabled=True))
            for chunk in self.chunks.values():
                chunk.end_step()
        finally:
            for chunk in self.chunks.values():
                chunk.begin_step(0, schedule.microbatches, False)
        propagate_input_grads(step_inputs.inputs, results)
        losses = {m: loss for r in results for m, loss in r.losses.items()}
        loss = sum(losses[m].to(last_device) for m in range(schedule.microbatches))
        events = [
            type(e)(e.stage, e.action, e.start - origin, e.end - origin)
            for r in results for e in r.events
        ]
        timeline = Timeline(
            stages=schedule.stages,
            events=tuple(events),
            chunks_per_stage=tuple(len(c) for c in schedule.chunks_of_stage),
            name=f"{schedule.name} (measured)",
        )
        self.memory = tuple(tracker.report() for tracker in self.trackers)
        return loss, timeline  # type: ignore[return-value]

    def run_forward(self, inputs: list[Any]) -> list[Any]:
        schedule = self.schedule
        caller = CallerState.capture()
        seed = step_seed()
        for chunk in self.chunks.values():
            chunk.begin_step(seed, schedule.microbatches, False)
        first_device = self.devices[schedule.placement[0]]
        inputs = [to_device(x, first_device) for x in inputs]

        def work(stage: int, endpoint: Any) -> Any:
            return run_forward_stage(schedule, self.plans[stage], self._stage_chunks(stage),
                                     endpoint, inputs)

        results = self._run_threads(work, caller)
        for chunk in self.chunks.values():
            chunk.end_step()
        outputs = {m: out for r in results for m, out in r.items()}
        return [outputs[m] for m in range(schedule.microbatches)]


def _chunk_params(model: nn.Sequential, balance: Sequence[int], chunk: int) -> list[torch.Tensor]:
    first = sum(balance[:chunk])
    return [p for i in range(first, first + balance[chunk]) for p in model[i].parameters()]


def propagate_input_grads(inputs: Sequence[Any] | None, results: Sequence[Any]) -> None:
    """Carry the first chunk's input gradients back into the caller's ``x`` (``x.grad``).

    ``inputs`` are the micro-batches as the first chunk received them: slices of ``x``
    (moved to its device), still attached to ``x``'s graph.
    """
    found = {m: grads for r in results for m, grads in r.input_grads.items()}
    if not found or inputs is None:
        return
    roots, grads = [], []
    for microbatch, input_grads in found.items():
        leaves = [t for t in flatten(inputs[microbatch]).leaves if differentiable(t)]
        for leaf, grad in zip(leaves, input_grads):
            if grad is not None and leaf.requires_grad:
                roots.append(leaf)
                grads.append(grad)
    if roots:
        torch.autograd.backward(roots, grads)
