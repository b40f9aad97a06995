"""Choose the whole plan: schedule x micro-batches x cut x recomputation, by simulation.

Why it is built this way
------------------------
Every candidate is priced by ``schedules.simulate`` with ``schedules.Costs``
built from the per-layer measurements at its micro-batch size, so that one
simulator is the model of both step time and memory (``Timeline.peak_bytes``),
the same one that draws and validates timetables. A candidate is a registered
schedule with its options, a micro-batch count M (any M: uneven last
micro-batches are scaled down), the exact cut by time for the schedule's chunk
count (and, under a memory limit, the fastest cut that provably fits; see
``plan.cuts``) and a checkpoint mode.

Simulating them all is the slow part, so candidates are visited in order of a
lower bound on their makespan (``plan.costs.makespan_lower_bound``, no
simulation), and the search stops once the bound passes the fastest fitting
plan found: the answer is the one an exhaustive search gives (``prune=False``).

With data-parallel replicas (``data_parallel=``) each candidate's stages hold what the
replicas hold (``cut.memory.sharded_fixed_bytes``: FSDP shards divide parameters, gradients
and optimizer state by the replicas and add the gathered working set) and its step pays
their collectives (``plan.replicas.replicas_costs``); the bound ignores those, so it stays
a lower bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from partitioners.errors import MemoryLimitError
from partitioners.cut.memory import NO_REPLICAS, DataParallelism
from partitioners.plan.costs import (
    Hop,
    candidate_costs,
    chunk_sums,
    makespan_lower_bound,
    without_exchanges,
    microbatch_scale,
    recomputed_flags,
)
from partitioners.plan.replicas import replicas_costs, with_step_collectives
from partitioners.plan.cuts import memory_capped_cut, time_cut
from partitioners.plan.space import (
    CostSource,
    CostTable,
    Options,
    build,
    check_checkpoints,
    check_limit,
    check_names,
    held,
    variants,
)
from partitioners.plan.space import (
    microbatch_counts as microbatch_counts_for,
)
from partitioners.measure.sizes import format_bytes
from schedules.recompute import CHECKPOINT_MODES
from schedules import Timeline, schedule_info, schedule_names, simulate

CHECKPOINTS: tuple[str, ...] = CHECKPOINT_MODES  # ties go to less recomputation
_TOLERANCE = 1e-9  # relative: a bound summed in another order may round above the makespan


@dataclass(frozen=True)
class Candidate:
    """One evaluated plan and its prediction.

    Attributes:
        schedule: the registered schedule name.
        schedule_options: its generator's options (``{"chunks_per_stage": 2}``).
        microbatches: M, micro-batches per step.
        balance: layers per model chunk (P entries, or P x chunks per stage).
        checkpoint: ``"never"``, ``"except_last"`` or ``"always"``.
        predicted: the simulated Timeline of one step.
        peak_memory: per stage, the predicted peak bytes.
        fits: whether every stage's peak is within the memory limit (True without one).
    """

    schedule: str
    schedule_options: Mapping[str, Any]
    microbatches: int
    balance: tuple[int, ...]
    checkpoint: str
    predicted: Timeline
    peak_memory: tuple[float, ...]
    fits: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule_options",
                           MappingProxyType(dict(self.schedule_options)))

    @property
    def step_time(self) -> float:
        """The predicted makespan of one step."""
        return self.predicted.makespan

    @property
    def bubble_fraction(self) -> float:
        return self.predicted.bubble_fraction

    def pipe_options(self) -> dict[str, Any]:
        """Keyword arguments for ``pipeline.Pipe`` that run this plan."""
        return {"chunks": self.microbatches, "balance": list(self.balance),
                "schedule": self.schedule, "schedule_options": dict(self.schedule_options),
                "checkpoint": self.checkpoint}

    def describe(self) -> str:
        """``"zb-v, 8 micro-batches, balance [...], checkpoint never"``."""
        options = "".join(f", {k}={v}" for k, v in self.schedule_options.items())
        return (f"{self.schedule}{options}, {self.microbatches} micro-batches, balance "
                f"{list(self.balance)}, checkpoint {self.checkpoint}")


@dataclass(frozen=True)
class Plan(Candidate):
    """The fastest fitting candidate, and every candidate evaluated, fastest fitting first.

    Attributes:
        candidates: each evaluated Candidate (the pick among them), ranked: those
            that fit by predicted step time, then peak memory; then those that do not.
        memory_limit: the limit planned for, bytes per stage, or None.
        split_backward: how the I and W of zero-bubble candidates were measured (as
            ``Pipe(split_backward=...)``); ``"auto"`` where nothing was measured.
    """

    candidates: tuple[Candidate, ...] = ()
    memory_limit: float | None = None
    split_backward: str = "auto"


def plan(
    costs: CostSource,
    stages: int,
    batch: int,
    memory_limit: float | None = None,
    hop: Hop | None = None,
    microbatch_counts: Sequence[int] | None = None,
    schedules: Sequence[str] | None = None,
    checkpoints: Sequence[str] = CHECKPOINTS,
    *,
    optimizer_factor: float = 0.0,
    action_overhead: float = 0.0,
    prune: bool = True,
    data_parallel: DataParallelism | None = None,
) -> Plan:
    """The fastest predicted plan whose every stage fits ``memory_limit``.

    Searches every registered schedule (interleaved 1F1B with two chunks per
    stage, ``zb`` at a few ``max_inflight`` points between ZB-H1 and ZB-H2) x
    micro-batch count x checkpoint mode, each with the exact cut by time for the
    schedule's chunk count (under a limit, also the fastest cut that fits, for
    one-chunk schedules), priced by ``schedules.simulate``.

    >>> from partitioners import LayerCost
    >>> from partitioners.plan.costs import linear_costs
    >>> layers = linear_costs([LayerCost(forward=1.0, backward=2.0, saved_bytes=10)] * 8, rows=1)
    >>> best = plan(layers, stages=2, batch=8)
    >>> best.describe(), best.step_time, best.peak_memory
    ('zb-v, 8 micro-batches, balance [2, 2, 2, 2], checkpoint never', 98.0, (80.0, 80.0))
    >>> plan(layers, stages=2, batch=8, memory_limit=50).describe()
    'dualpipe-v, 8 micro-batches, balance [2, 2, 2, 2], checkpoint always'

    Args:
        costs: per-layer costs (``LayerCost``, a Profile's loss charged to the last
            stage) by micro-batch rows: a mapping ``rows -> costs`` (then M ranges
            over the counts whose largest micro-batch, ``ceil(batch / M)`` rows, is
            a key), or a callable ``rows -> costs`` called once per size needed
            (``profile`` on demand, or ``plan.costs.linear_costs``). Smaller last
            micro-batches cost in proportion to their rows.
        stages: pipeline stages P.
        batch: rows per step, split into M micro-batches as ``torch.tensor_split`` does.
        memory_limit: bytes per stage: ``(2 + optimizer_factor) x`` parameter bytes
            plus the activations the simulator predicts held at the peak
            (recomputed micro-batches keep only their input); None: no limit.
        hop: the time of a transfer between stages: seconds, or ``schedules.Link``
            (latency + bytes / bandwidth) of the activation crossing; None: 0.
        microbatch_counts: the Ms to try; None: every M a mapping has costs for, or
            for a callable powers of two and multiples of P up to ``min(batch, 4P)``.
            A schedule's ``min_microbatches`` is honoured.
        schedules: registered names to search; None: all (``schedule_names()``).
        checkpoints: recomputation modes to search.
        optimizer_factor: optimizer-state bytes per parameter byte (2 for Adam).
        action_overhead: the runtime's own seconds per action (F, B, I or W), beside
            the compute (``pipeline.predict.overheads.action_overhead`` measures it); it
            makes more micro-batches and more chunks cost what they do.
        prune: skip candidates whose makespan bound exceeds the best found; False
            simulates every candidate (same pick, all of them in ``candidates``).
        data_parallel: how each stage's replicas hold it (``DataParallelism``: their
            count, FSDP shards or whole copies, ``reshard_after_forward``, the hop
            between them); None: no replicas. Memory per stage then is
            ``cut.memory.sharded_fixed_bytes`` plus activations, and the step adds the
            replicas' all-gathers, reduce-scatters or all-reduces
            (``plan.replicas.replicas_costs``).

    Returns:
        The Plan.

    Raises:
        ValueError: bad arguments.
        MemoryLimitError: a memory limit no candidate fits (a ValueError); its
            ``smallest_limit`` and message give the smallest limit that would fit,
            the message also the plan that fits it.
    """
    _check_counts(stages, batch)
    if not (isinstance(action_overhead, (int, float)) and 0 <= action_overhead < math.inf):
        raise ValueError(f"action_overhead: expected seconds >= 0, got {action_overhead!r}")
    if data_parallel is not None and not isinstance(data_parallel, DataParallelism):
        raise TypeError(f"data_parallel: expected a DataParallelism or None, got "
                        f"{data_parallel!r}")
    search = _Search(CostTable(costs), stages, batch, check_limit(memory_limit),
                     0.0 if hop is None else hop, optimizer_factor, float(action_overhead),
                     data_parallel or NO_REPLICAS)
    names = check_names(schedules)
    modes = check_checkpoints(checkpoints)
    counts = microbatch_counts_for(costs, stages, batch, microbatch_counts)
    found = search.run(search.queue(names, counts, modes), prune)
    if not found:
        raise ValueError(f"no schedule of {', '.join(names)} can cut the model into {stages} "
                         f"stages with {counts} micro-batches")
    ranked = tuple(sorted(found, key=_rank))
    pick = ranked[0]
    if not pick.fits:
        smallest = min(ranked, key=lambda c: (max(c.peak_memory), _rank(c)))
        least = max(smallest.peak_memory)
        raise MemoryLimitError(
            f"no plan fits memory_limit={_bytes(memory_limit or 0)} per stage (of {len(ranked)} "
            f"candidates); the smallest limit that fits is {_bytes(least)}, "
            f"with {smallest.describe()}", math.ceil(least))
    fields = {name: getattr(pick, name) for name in Candidate.__dataclass_fields__}
    return Plan(**fields, candidates=ranked, memory_limit=search.limit)


def _bytes(value: float) -> str:
    """``"1.50 GiB (1610612736 bytes)"``: readable, and the whole bytes that cover it."""
    return f"{format_bytes(value)} ({math.ceil(value)} bytes)"


def _check_counts(stages: int, batch: int) -> None:
    for name, value in (("stages", stages), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")


def _rank(candidate: Candidate) -> tuple[Any, ...]:
    order = schedule_names()
    index = order.index(candidate.schedule) if candidate.schedule in order else len(order)
    return (not candidate.fits, candidate.step_time, max(candidate.peak_memory), index,
            tuple(candidate.schedule_options.items()), candidate.microbatches,
            CHECKPOINTS.index(candidate.checkpoint), candidate.balance)


@dataclass(frozen=True)
class _Entry:
    """A candidate not yet simulated: its bound, and what it needs to be simulated."""

    bound: float
    name: str
    options: Options
    microbatches: int
    checkpoint: str
    balance: tuple[int, ...]


class _Search:
    """One planning run: the inputs, and its cuts, each computed once."""

    def __init__(self, table: CostTable, stages: int, batch: int, limit: float | None,
                 hop: Hop, optimizer_factor: float, overhead: float,
                 data_parallel: DataParallelism = NO_REPLICAS) -> None:
        self.table, self.stages, self.batch, self.limit = table, stages, batch, limit
        self.hop, self.optimizer_factor, self.overhead = hop, optimizer_factor, overhead
        self.data_parallel = data_parallel
        # The memory-capped cut's linear model charges (2 + factor) x parameter bytes; FSDP
        # shards hold (2 + optimizer) / replicas of them plus whole gradients and, at most,
        # every unit gathered: 2 more (never less than the simulator's figure).
        sharded = data_parallel.sharded and data_parallel.active
        self.cut_factor = ((2 + optimizer_factor) / data_parallel.replicas if sharded
                           else optimizer_factor)
        self._cuts: dict[tuple[int, int], tuple[int, ...]] = {}
        self._memory_cuts: dict[tuple[int, tuple[float, ...], str], tuple[int, ...]] = {}

    def rows(self, microbatches: int) -> int:
        return -(-self.batch // microbatches)

    def queue(self, names: Sequence[str], counts: Sequence[int],
              modes: Sequence[str]) -> list[_Entry]:
        """Every candidate with its time cut and bound, lowest bound first."""
        entries = []
        for name in names:
            info = schedule_info(name)
            for m in counts:
                exchanges = any(cost.exchange for cost in self.table.at(self.rows(m)))
                for options in variants(name, self.stages, m, exchanges):
                    chunks = self.stages * info.chunks(**dict(options))
                    layers = len(self.table.at(self.rows(m)))
                    if chunks > layers:
                        continue
                    cut = self.time_cut(chunks, m)
                    entries += [_Entry(self.bound(name, options, m, mode, cut), name, options,
                                       m, mode, cut) for mode in modes]
        return sorted(entries, key=lambda e: e.bound)

    def time_cut(self, chunks: int, microbatches: int) -> tuple[int, ...]:
        key = (chunks, self.rows(microbatches))
        if key not in self._cuts:
            self._cuts[key] = time_cut(self.table.at(key[1]), chunks)
        return self._cuts[key]

    def bound(self, name: str, options: Options, microbatches: int, checkpoint: str,
              cut: tuple[int, ...]) -> float:
        info = schedule_info(name)
        sums = chunk_sums(self.table.at(self.rows(microbatches)), cut, self.overhead)
        if dict(options).get("overlap") and sums.exchange:  # pairs may hide every exchange
            sums = without_exchanges(sums)
        scale = microbatch_scale(self.batch, microbatches) or (1.0,) * microbatches
        placement = _placement(info.placement, self.stages, len(cut))
        return makespan_lower_bound(sums, placement, info.split_backward, scale,
                                    recomputed_flags(checkpoint, microbatches), self.hop)

    def run(self, entries: Sequence[_Entry], prune: bool) -> list[Candidate]:
        """Simulate the entries in order, stopping when a bound passes the best that fits."""
        found: list[Candidate] = []
        best = float("inf")
        for entry in entries:
            if prune and entry.bound > best * (1 + _TOLERANCE):
                break
            for candidate in self.evaluate(entry, best if prune else float("inf")):
                found.append(candidate)
                if candidate.fits:
                    best = min(best, candidate.step_time)
        return found

    def evaluate(self, entry: _Entry, best: float) -> list[Candidate]:
        """The entry simulated with its time cut; if that does not fit, with a memory cut too."""
        first = self.simulate(entry)
        if first.fits or self.limit is None:
            return [first]
        info = schedule_info(entry.name)
        if info.chunks(**dict(entry.options)) != 1:
            return [first]
        cut = self.memory_cut(entry)
        if cut == entry.balance:
            return [first]
        bound = self.bound(entry.name, entry.options, entry.microbatches, entry.checkpoint, cut)
        if bound > best * (1 + _TOLERANCE):
            return [first]
        second = _Entry(bound, entry.name, entry.options, entry.microbatches,
                        entry.checkpoint, cut)
        return [first, self.simulate(second)]

    def memory_cut(self, entry: _Entry) -> tuple[int, ...]:
        counts = held(entry.name, self.stages, entry.microbatches, entry.options)
        key = (self.rows(entry.microbatches), counts, entry.checkpoint)
        if key not in self._memory_cuts:
            self._memory_cuts[key] = memory_capped_cut(
                self.table.at(key[0]), counts, self.limit or 0.0, self.cut_factor,
                entry.checkpoint)
        return self._memory_cuts[key]

    def simulate(self, entry: _Entry) -> Candidate:
        schedule = build(entry.name, self.stages, entry.microbatches, entry.options)
        sums = chunk_sums(self.table.at(self.rows(entry.microbatches)), entry.balance,
                          self.overhead)
        costs = candidate_costs(sums, microbatch_scale(self.batch, entry.microbatches),
                                entry.checkpoint, self.hop, self.optimizer_factor,
                                schedule.placement)
        costs, collectives = replicas_costs(costs, sums, schedule, self.data_parallel, self.hop,
                                            self.optimizer_factor)
        timeline = with_step_collectives(simulate(schedule, costs=costs), costs, schedule,
                                         collectives)
        peak = timeline.peak_bytes or (0.0,) * self.stages
        fits = self.limit is None or max(peak) <= self.limit
        return Candidate(entry.name, dict(entry.options), entry.microbatches, entry.balance,
                         entry.checkpoint, timeline, tuple(peak), fits)


def _placement(kind: str, stages: int, chunks: int) -> tuple[int, ...]:
    """The stage of each chunk: a loop (c mod P) or a V (min(c, 2P-1-c))."""
    if kind == "v":
        return tuple(min(c, 2 * stages - 1 - c) for c in range(chunks))
    return tuple(c % stages for c in range(chunks))
