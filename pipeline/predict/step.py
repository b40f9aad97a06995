"""Predict a Pipe's training step before running it: measured chunk costs, simulated schedule.

Every chunk is measured where and how it will run (``pipeline.predict.probe``: its own
layers as a unit, on its device, at the step's largest micro-batch, in the
step's checkpoint mode, split into I and W when the schedule splits); each
hop costs what ``Ranks.hops`` measured the first time a prediction asked
(``pipeline.group.links``: latency + bytes / bandwidth, bytes from the
boundary's real payload); each action also pays the executor's own per-action
cost (measured on an almost empty action). Across ranks every rank measures its
own chunks and the costs are gathered, so every rank simulates the same
``Costs`` and returns the same Timeline.

Memory beside it, per stage: parameters, their gradients, the optimizer's
state (when one is given), receive buffers, and the activations the schedule
holds (each chunk's saved bytes per micro-batch in flight, or only its input
for a recomputed one), as ``schedules.simulate`` traces them.

With data-parallel replicas, the bytes are this rank's shards plus what a sharded stage
gathers within a step (``pipeline.predict.fixed_bytes``), and the step pays the
replicas' collectives (``pipeline.predict.overheads``): FSDP's all-gathers at each unit's
first forward (micro-batch 0's way through the chunks) and reduce-scatters after each
stage's last backward, or with ``reshard_after_forward`` a gather on every forward and
backward that finds the unit freed; whole copies' all-reduces after the last backward.
Sharded chunks are probed gathered (``runner.data_parallel.gathered()``), so that their measured costs
are compute alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from schedules import Costs, Schedule, Timeline, simulate

from schedules.recompute import CheckpointMode
from schedules.dependencies import crossings
from pipeline.compute.chunk import ChunkRunner
from pipeline.compute.microbatch import batch_size, to_device
from pipeline.group.hops import HopModel
from pipeline.group.ranks import OneProcess, Ranks
from pipeline.payloads.tree import from_wire, map_tensors, to_wire
from pipeline.predict.contention import ChunkWork, contended, factor_across_ranks, slowed
from partitioners.plan.replicas import with_step_collectives
from pipeline.predict.fixed_bytes import FixedBytes, fixed_bytes
from pipeline.predict.overheads import (
    Collectives,
    action_overhead,
    in_actions,
    measured_hop_delay,
    refined,
    replicas_link,
    replicas_step,
    stage_collectives,
)
from pipeline.predict.probe import ChunkCosts, probe_chunk
from pipeline.runtime.runner import Runner


@dataclass(frozen=True)
class Prediction:
    """A predicted step and what it was built from.

    Attributes:
        timeline: the simulated step (``memory`` and ``peak_bytes`` included).
        costs: the ``schedules.Costs`` it was simulated with (seconds, bytes).
        chunks: each chunk's measured costs, in chunk order.
        fixed: per stage, the bytes held throughout.
        overhead: per stage, the executor's seconds per action, added to each action.
        hops: the calibrated hop model.
        contention: per stage, how much slower its chunks computed with every stage
            computing at once than alone (``pipeline.predict.contention``); 1.0 where stages
            do not share cores.
        collectives: per stage, its data-parallel collectives (``overheads.Collectives``).
        collective_seconds: per stage, the seconds its data-parallel collectives take in
            the step (gathers and reductions; all 0 without replicas).
    """

    timeline: Timeline
    costs: Costs
    chunks: tuple[ChunkCosts, ...]
    fixed: tuple[FixedBytes, ...]
    overhead: tuple[float, ...]
    hops: HopModel
    contention: tuple[float, ...] = ()
    collectives: tuple[Collectives, ...] = ()
    collective_seconds: tuple[float, ...] = ()

    @property
    def peak_activation_bytes(self) -> tuple[float, ...]:
        """Per stage, the most activation bytes held at once (peak bytes less fixed ones),
        comparable with ``MemoryReport.peak_bytes`` of ``Pipe.memory``."""
        peaks = self.timeline.peak_bytes or (0.0,) * len(self.fixed)
        return tuple(peak - fixed.total for peak, fixed in zip(peaks, self.fixed))


def predict_step(
    runner: Runner,
    inputs: list[Any] | None,
    targets: list[Any] | None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    ranks: Ranks | None = None,
    measured: Timeline | Sequence[Timeline] | None = None,
) -> Prediction:
    """Measure this runner's chunks, gather every stage's costs and simulate the step.

    With data-parallel replicas every rank of the mesh calls it at once: a stage's
    replicas calibrate the hop between them and, sharded, gather their units together.

    Args:
        runner: a ``LocalRunner`` or ``DistRunner`` (its ``chunks``, ``schedule``, and
            with a group its ``transport``; with replicas its ``sharding`` and
            ``data_parallel``).
        inputs: the micro-batches of ``x`` (where the first chunk runs), else None.
        targets: the micro-batches of the target (where the last chunk runs), else None.
        optimizer: counted for its state (Adam: two tensors per parameter).
        ranks: the Pipe's processes (``pipeline.group.ranks``), which calibrate the hops
            once and keep them; one process by default.
        measured: measured Timelines of earlier steps of this runner (where there are
            some: rank 0 with a group), or one, to refine the prediction (None: the
            runner's last steps, ``Runner.recent_timelines``): the hop latency
            from the delays their waiting consumers saw (``calibration.measured_hop_delay``,
            pooled over the steps), and each stage's compute by the ratio of its median
            measured busy time to the one predicted (ranks computing at once on shared
            cores, or threads sharing the GIL, run slower than a chunk timed alone).
            None keeps the probes' and the ping-pong's.

    Returns:
        The Prediction, the same on every rank.

    Raises:
        ValueError: a rank lacks the input or the target its chunks need.
        PeerError: a rank failed or did not answer within ``timeout``.
    """
    ranks = ranks if ranks is not None else OneProcess(60.0)
    schedule: Schedule = runner.schedule
    device = _any_device(runner)  # with a group, this rank's device: its chunks are all there
    stages_here = len({schedule.placement[c] for c in runner.chunks})
    rows = _rows(inputs, targets, ranks, device)
    largest = max(range(len(rows)), key=lambda m: rows[m])
    hops = ranks.hops(_stage_devices(runner), schedule)  # every rank, before anything fails
    recent = runner.recent_timelines()  # every rank: with a group, gathered on the first
    measured = measured if measured is not None else (recent or None)
    link = replicas_link(runner)  # every replica, before anything fails
    with runner.data_parallel.gathered():
        local, failure, work = _measure_chunks(runner, inputs, targets, largest, ranks, device)
        factor, failure = _contention(runner, work, failure, ranks, device, stages_here)
    overhead = action_overhead(device)
    fixed_local = fixed_bytes(runner, optimizer, local)
    delay, busy = _from_measured(schedule, measured)
    chunks, overheads, fixed, delay, busy, factors, found = _gather(
        (local, (overhead,) * stages_here, fixed_local, failure, delay, busy, factor,
         {s: c.fields for s, c in stage_collectives(runner, link).items()}), ranks, device)
    if delay is not None:
        payloads = [chunks[c].input_bytes for c in range(1, schedule.chunks)]
        hops = refined(hops, delay, sum(payloads) / max(len(payloads), 1))
    costs = build_costs(schedule, chunks, overheads, fixed, hops, rows,
                        runner.chunks[next(iter(runner.chunks))].options.checkpoint)
    costs, timeline, seconds = _simulated(schedule, costs, factors, busy, found)
    stages = range(schedule.stages)
    return Prediction(timeline, costs, tuple(chunks[c] for c in range(schedule.chunks)),
                      tuple(fixed[s] for s in stages), overheads, hops, tuple(factors),
                      tuple(found.get(s, Collectives()) for s in stages), seconds)


def _simulated(schedule: Schedule, costs: Costs, factors: Sequence[float],
               busy: tuple[float, ...] | None, found: dict[int, Collectives]
               ) -> tuple[Costs, Timeline, tuple[float, ...]]:
    """The costs and the timeline: slowed by contention, scaled to the measured busy times
    (less the collectives inside actions, which they hold), with the replicas' collectives;
    and per stage the seconds of those collectives."""
    costs, timeline = contended(costs, schedule, factors)
    inside = in_actions(schedule, found)
    if busy is not None:
        costs = slowed(costs, schedule, [max(b - i, 0.0) / p if p > 0 else 1.0
                                         for b, i, p in zip(busy, inside, timeline.busy)])
        timeline = simulate(schedule, costs=costs)
    gathering, outside = replicas_step(costs, schedule, found)
    if gathering is not costs:  # gathers on the actions: simulated again
        costs, timeline = gathering, simulate(schedule, costs=gathering)
    timeline = with_step_collectives(timeline, costs, schedule, outside)
    return costs, timeline, tuple(i + o for i, o in zip(inside, outside.last))


def _from_measured(schedule: Schedule, measured: Timeline | Sequence[Timeline] | None
                   ) -> tuple[float | None, tuple[float, ...] | None]:
    """What measured steps refine: the mean hop delay their waiting stages saw, and each
    stage's median busy time (None, None without any)."""
    steps = (measured,) if isinstance(measured, Timeline) else tuple(measured or ())
    if not steps:
        return None, None
    busy = tuple(statistics.median(step.busy[s] for step in steps)
                 for s in range(schedule.stages))
    return measured_hop_delay(schedule, *steps), busy


def build_costs(
    schedule: Schedule,
    measured: dict[int, ChunkCosts],
    overhead: tuple[float, ...],
    fixed: dict[int, FixedBytes],
    hops: HopModel,
    rows: list[int],
    checkpoint: CheckpointMode,
) -> Costs:
    """The ``Costs`` of a step from measured chunks.

    A recomputed micro-batch's forward keeps no graph and its B (or I) re-runs the
    forward: ``Costs`` adds the chunk's F to those, so F is the recomputed forward
    and B what remains of the measured recomputed backward. Each action also pays
    its stage's executor overhead once, and an action whose result goes to another
    stage the send's cost to its own stage (``HopModel.send_seconds``).
    """
    recompute = checkpoint != "never"
    placement = schedule.placement
    forward, backward, input_grad, weight_grad = [], [], [], []
    for c in range(schedule.chunks):
        cost, extra = measured[c], overhead[placement[c]]
        send_on = 0.0 if c + 1 == schedule.chunks else hops.send_seconds(
            placement[c], placement[c + 1], cost.output_bytes)
        send_back = 0.0 if c == 0 else hops.send_seconds(
            placement[c], placement[c - 1], cost.input_bytes)
        if recompute:
            f = cost.recompute_forward + extra
            forward.append(f + send_on)
            backward.append(max(cost.recompute_backward + extra - f, 0.0) + send_back)
            input_grad.append(max(cost.recompute_input_grad + extra - f, 0.0) + send_back)
        else:
            forward.append(cost.forward + extra + send_on)
            backward.append(cost.backward + extra + send_back)
            input_grad.append(cost.input_grad + extra + send_back)
        weight_grad.append(cost.weight_grad + extra)
    top = max(rows)
    fixed_per_chunk = [0.0] * schedule.chunks
    for stage, owned in enumerate(schedule.chunks_of_stage):
        fixed_per_chunk[owned[0]] = float(fixed[stage].total)
    return Costs(
        forward=forward, backward=backward, input_grad=input_grad, weight_grad=weight_grad,
        comm=hops, microbatch_scale=[r / top for r in rows],
        recompute=checkpoint,
        activation_bytes=[float(measured[c].saved_bytes) for c in range(schedule.chunks)],
        input_bytes=[float(measured[c].input_bytes) for c in range(schedule.chunks)],
        fixed_bytes=fixed_per_chunk,
        weight_bytes=[float(measured[c].weight_bytes) for c in range(schedule.chunks)],
        exchange=[measured[c].exchange for c in range(schedule.chunks)],
    )


# -- measuring this process's chunks ----------------------------------------------------------


def _rows(inputs: list[Any] | None, targets: list[Any] | None, ranks: Ranks,
          device: torch.device) -> list[int]:
    """Rows of each micro-batch, known where x or the target is, shared with every rank."""
    known = inputs if inputs is not None else targets
    rows = None if known is None else [batch_size(part) for part in known]
    everyone = ranks.gather(rows, "sharing the micro-batch sizes", device)
    found: list[list[int]] = [r for r in everyone if r is not None]
    if not found:
        raise ValueError("predict() needs x on the rank of the first chunk and the target on "
                         "the rank of the last chunk, got neither on any rank")
    return found[0]


def _measure_chunks(runner: Runner, inputs: list[Any] | None, targets: list[Any] | None,
                    largest: int, ranks: Ranks, device: torch.device
                    ) -> tuple[dict[int, ChunkCosts], str | None, dict[int, ChunkWork]]:
    """Each local chunk's costs, its input the previous chunk's output for the largest
    micro-batch (sent on from rank to rank where the placement crosses), the first
    failure on any rank so far (in one process a failure raises at once), and each
    local chunk with the input and target it was probed on."""
    schedule: Schedule = runner.schedule
    chunks: dict[int, ChunkRunner] = runner.chunks
    split_backward = bool(schedule.split_backward)
    recompute = chunks[next(iter(chunks))].options.checkpoint != "never"
    measured: dict[int, ChunkCosts] = {}
    work: dict[int, ChunkWork] = {}
    carried: Any = None
    failure: str | None = None
    crossing = {chunk for chunk, _, _ in crossings(schedule.placement)}
    for c in range(schedule.chunks):
        if c in chunks and failure is None:
            try:
                chunk = chunks[c]
                source = _chunk_input(c, inputs, carried, largest)
                target = None
                if chunk.spec.is_last:
                    if targets is None:
                        raise ValueError(f"predict() needs the target on the rank of the last "
                                         f"chunk (stage {schedule.placement[c]}), got None")
                    target = to_device(targets[largest], chunk.device)
                source = to_device(source, chunk.device)
                cost, carried = probe_chunk(chunk, source, target, schedule.microbatches,
                                            split_backward, recompute)
                if runner.exchange is not None:
                    cost = replace(cost, exchange=_exchange_wait(runner.exchange, chunk,
                                                                 largest, source))
                measured[c] = cost
                work[c] = (chunk, source, target)
            except Exception as error:  # shared below, so that no rank waits in vain
                failure = f"{type(error).__name__}: {error}"
                if ranks.size == 1:  # no other rank waits for it
                    raise
        if ranks.size > 1 and c in crossing:
            carried, failure = _pass_on(carried, failure, schedule.placement[c], c in chunks,
                                        ranks, device)
    return measured, failure, work


def _exchange_wait(exchange: Any, chunk: ChunkRunner, microbatch: int, source: Any) -> float:
    """Seconds one forward of ``chunk`` waits on its expert all-to-alls when nothing covers
    them (a forward without a graph; every rank of the ``ep`` group runs it alike)."""
    before = exchange.counts.waited
    chunk.infer(microbatch, source)
    return float(exchange.counts.waited - before)


def _contention(runner: Runner, work: dict[int, ChunkWork], failure: str | None,
                ranks: Ranks, device: torch.device, stages_here: int
                ) -> tuple[tuple[float, ...], str | None]:
    """The contention factors of this process's stages (``pipeline.predict.contention``) and the
    failure so far. With a group every rank takes part, failed or not; under NCCL (a GPU
    per rank, nothing to share) none is measured, nor with tensor or expert parallelism
    (its chunks all-reduce or exchange tokens inside, and a loop timed for a window runs as
    many times as the clock says: the ranks' counts could differ and one would wait for
    the other forever)."""
    schedule: Schedule = runner.schedule
    if not ranks.shares_cores or runner.boundaries is not None or runner.exchange is not None:
        return (1.0,) * stages_here, failure
    mine = [] if failure is not None else [work[c] for c in sorted(work)]
    factor, failed = factor_across_ranks(mine, schedule.microbatches, ranks, device)
    return (factor,), failure or failed


def _chunk_input(chunk: int, inputs: list[Any] | None, carried: Any, largest: int) -> Any:
    if chunk > 0:
        return carried
    if inputs is None:
        raise ValueError("predict() needs x on the rank of the first chunk, got None")
    return inputs[largest]


def _pass_on(carried: Any, failure: str | None, source: int, mine: bool, ranks: Ranks,
             device: torch.device) -> tuple[Any, str | None]:
    """The producing rank's output (on the CPU) and any failure so far, on every rank. The
    output crosses as the runtime's payloads do (``to_wire``)."""
    wired = None
    if mine and failure is None:
        try:
            wired = to_wire(map_tensors(carried, lambda t: t.detach().cpu()))
        except (TypeError, ValueError) as error:  # shared below, as a failure
            failure = f"{type(error).__name__}: {error}"
    shared = ranks.gather((wired, failure), "passing a chunk's output on for predict()", device)
    failures = [f for _, f in shared if f is not None]
    wired = shared[source][0]
    return None if wired is None else from_wire(*wired), (failures[0] if failures else None)


def _any_device(runner: Runner) -> torch.device:
    return runner.chunks[next(iter(runner.chunks))].device


def _stage_devices(runner: Runner) -> list[torch.device]:
    """Each local stage's device, in stage order: every stage's in one process, this rank's
    with a group (``Ranks.hops`` takes them so)."""
    found = {runner.schedule.placement[c]: chunk.device for c, chunk in runner.chunks.items()}
    return [found[stage] for stage in sorted(found)]


def _gather(mine: tuple[Any, ...], ranks: Ranks, device: torch.device
            ) -> tuple[dict[int, ChunkCosts], tuple[float, ...], dict[int, FixedBytes],
                       float | None, tuple[float, ...] | None, tuple[float, ...],
                       dict[int, Collectives]]:
    """Every rank's (costs, overhead, fixed bytes, failure, hop delay, measured busy time,
    contention factors, collectives) on every rank: the chunks' costs, the overheads by
    stage, the fixed bytes, the first hop delay and busy times measured, the contention
    factors by stage, the collectives by stage; a failure raises on all of them."""
    everyone = ranks.gather(mine, "gathering the measured costs for predict()", device)
    failures = [f"rank {rank}: {entry[3]}" for rank, entry in enumerate(everyone) if entry[3]]
    if failures:
        raise ValueError(f"predict() failed while measuring the chunks: {failures[0]}")
    measured: dict[int, ChunkCosts] = {}
    all_fixed: dict[int, FixedBytes] = {}
    collectives: dict[int, Collectives] = {}
    for costs, _, stage_fixed, _, _, _, _, collected in everyone:
        measured.update(costs)
        all_fixed.update(stage_fixed)
        collectives.update({s: Collectives(*fields) for s, fields in collected.items()})
    delays = [entry[4] for entry in everyone if entry[4] is not None]
    busy = [entry[5] for entry in everyone if entry[5] is not None]
    return (measured, tuple(o for entry in everyone for o in entry[1]), all_fixed,
            delays[0] if delays else None, busy[0] if busy else None,
            tuple(factor for entry in everyone for factor in entry[6]), collectives)
