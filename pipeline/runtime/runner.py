"""The Runner protocol (threads in one process, or one stage per rank) and what runners share."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn

from schedules import CommPlan, Event, Schedule, Timeline, comm_plan, forward_only
from schedules.comm import Strategy

from pipeline.compute.activations import ActivationTracker, MemoryReport
from pipeline.compute.chunk import ChunkRunner
from pipeline.compute.recompute import step_seed
from pipeline.payloads.tree import differentiable, flatten
from pipeline.runtime.data_parallel import DataParallel, Sharding
from pipeline.runtime.executor import StageResult
from pipeline.runtime.stage_steps import StageSteps


RECENT_STEPS = 5  # measured steps that refine predict(): one step on shared cores is noisy


class PendingTimeline:
    """A step's measured Timeline, which may still have to be gathered across ranks.

    ``result()`` builds it once (with a group: gathering it first if no gather has, a
    collective of every rank of the pipeline) and keeps it; None where the timeline is not
    kept (ranks other than the first's).
    """

    __slots__ = ("_resolve", "_value", "_done")

    def __init__(self, resolve: Callable[[], Timeline | None]) -> None:
        self._resolve = resolve
        self._value: Timeline | None = None
        self._done = False

    @classmethod
    def ready(cls, timeline: Timeline | None) -> PendingTimeline:
        pending = cls(lambda: timeline)
        pending.result()
        return pending

    def result(self) -> Timeline | None:
        if not self._done:
            self._value = self._resolve()
            self._done = True
        return self._value


class Runner(Protocol):
    """Runs a Pipe's steps: threads (``LocalRunner``) or one stage per rank (``DistRunner``).

    Which one a Pipe gets is decided once, with its ``Ranks``, by ``runtime.build.processes``.

    Attributes:
        schedule: the Schedule it runs.
        chunks: this process's chunks by model-chunk index (all of them in one process).
        local_layers: the model's layers this process runs (all of them in one process).
        memory: per local stage, the activation memory of the last measured step
            (``Pipe.measure_memory``; else empty).
        trackers: per local stage, what counts its saved activations while measuring.
        sharding: how this stage's data-parallel replicas hold it (``NOT_SHARDED`` in one
            process).
        data_parallel: what the stage's replicas do together (``Alone`` in one process).
        boundaries: a traced cut's tensor-parallel boundaries (``units.tp_graph``), whose
            all-reduces they count; None without them.
        exchange: a traced cut's expert-parallel token exchange (``units.ep_dispatch``),
            whose all-to-alls it counts; None without one.
    """

    schedule: Schedule
    chunks: dict[int, ChunkRunner]
    local_layers: list[int]
    memory: tuple[MemoryReport, ...]
    trackers: tuple[ActivationTracker, ...]
    data_parallel: DataParallel
    boundaries: Any
    exchange: Any

    @property
    def sharding(self) -> Sharding: ...

    def run_step(
        self, inputs: list[Any] | None, targets: list[Any] | None, weights: list[float] | None
    ) -> tuple[torch.Tensor, PendingTimeline]:
        """One training step; the batch loss (every rank) and the measured timeline."""

    def run_forward(self, inputs: list[Any] | None) -> list[Any] | None:
        """Forwards only; the last chunk's outputs by micro-batch (None off its rank)."""

    def recent_timelines(self) -> tuple[Timeline, ...]:
        """The measured Timelines of the last ``RECENT_STEPS`` steps, oldest first, where
        this process holds them whole (one process; the first rank of a group), else
        empty. With a group every rank calls it: it gathers what no read gathered yet."""

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor: ...

    def release(self) -> None:
        """Release what outlives a step without waiting for other ranks (a finalizer)."""

    def close(self) -> None:
        """Release communicators, threads' state and buffers."""


class Plans:
    """A schedule's comm plans, training and forward-only, and each stage's part of them."""

    def __init__(self, schedule: Schedule, strategy: Strategy = "overlap") -> None:
        self.schedule = schedule
        self.training: CommPlan = comm_plan(schedule, strategy)
        self.forward: CommPlan = comm_plan(forward_only(schedule))
        self._stages: dict[tuple[int, bool], StageSteps] = {}

    def stage(self, stage: int, infer: bool) -> StageSteps:
        """Stage ``stage``'s steps (forward-only with ``infer``), derived once."""
        found = self._stages.get((stage, infer))
        if found is None:
            found = self._stages[(stage, infer)] = StageSteps.of(
                self.forward if infer else self.training, stage)
        return found


@contextmanager
def step_of(chunks: Iterable[ChunkRunner], schedule: Schedule, seed: int | None = None
            ) -> Iterator[None]:
    """Around one step: every chunk starts it with this step's seed (``seed``, or one drawn
    here), commits what the step deferred once it succeeded, and forgets everything the
    step kept, whatever happened."""
    chunks = list(chunks)
    seed = step_seed() if seed is None else seed
    split = {chunk for _, chunk in schedule.split_backward}
    for chunk in chunks:
        chunk.begin_step(seed, schedule.microbatches, chunk.spec.index in split)
    try:
        yield
        for chunk in chunks:
            chunk.end_step()
    finally:
        for chunk in chunks:
            chunk.begin_step(0, schedule.microbatches)


def measured_timeline(schedule: Schedule, events: Sequence[Event], name: str) -> Timeline:
    """The measured Timeline of a step, from every stage's events on one clock."""
    return Timeline(
        stages=schedule.stages,
        events=tuple(events),
        chunks_per_stage=tuple(len(c) for c in schedule.chunks_of_stage),
        name=f"{schedule.name} ({name})",
    )


def propagate_input_grads(inputs: Sequence[Any] | None, results: Sequence[StageResult]) -> None:
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
