"""bench_plan --ranks 2, on the ranks: each model's auto pick, grid, torch runs and memory case.

Per model (``_plan_workloads.WORKLOADS``), on two gloo ranks; a runner is one configuration
that takes a step per call, ours (``OurPipe``) or torch's (``TorchPipelining``):

- the grid: every schedule x M in COUNTS with the cut by time that rank 0 planned
  (``_plan_grid.py``), no recomputation;
- the pick: ``Pipe(chunks="auto", schedule="auto", checkpoint="never", sample=x)``, the
  real auto path (rank 0 profiles without a loss target and plans with its own hop and
  per-action overhead calibration, every rank runs the pick); its other candidates that
  the grid lacks (other Ms, other cuts) are measured too;
- torch.distributed.pipelining's GPipe and 1F1B at COUNTS on our pick's cut (or the
  best-ranked one-chunk cut when the pick has more chunks per stage).

Every one of them runs round-robin (a barrier before each step, one warm-up round) so
that others' load hits them alike. Then the memory case: 1F1B at M=8 without and with
full recomputation run once inside ``pipe.measure_memory()`` for their peaks (2 x parameter
bytes plus the saved activations pipe.memory measured); a limit below the first
(``choose_limit``: LIMIT_SHARE of it unless no plan is predicted to fit that: the MLP's
parameters outweigh its activations); the auto Pipe planned under it with
``checkpoint="auto"``, its peak measured the same way, and its step timed round-robin
against 1F1B+always. The parent (benchmarks/_plan_report.py) prints the tables.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from _plan_grid import (
    Grid,
    Predicted,
    calibrated_hop,
    grid_entry,
    grid_plan,
    predicted,
    table_rows,
    torch_balance,
)
from _plan_workloads import COUNTS, TIMEOUT, WORKLOADS, Workload
from _vs_torch_ranks import TorchStage
from pipeline import Pipe, Sample

TORCH_SCHEDULES = ("gpipe", "1f1b")
LIMIT_SHARE = 0.8  # the memory limit: this share of 1F1B's measured peak at M=8
REFERENCE_M = 8  # the memory case's 1F1B
JUST_BELOW = 0.99  # the limit's share of 1F1B's peak where no plan is predicted below it
HEADROOM = 0.01  # a leanest plan less far below 1F1B's peak counts as none below it
PEAK_STEPS = 2  # steps of each measured run (the worst counts)

Span = tuple[float, float]  # one step on one rank: (start, end), time.perf_counter seconds


# -- the runners and what a rank reports ------------------------------------------------------


class OurPipe:
    """Our Pipe over the group with ``options`` (a candidate's ``pipe_options()``, or
    ``chunks="auto"`` and friends: then rank 0 plans from the batch, ``sample``).

    x and y live on every rank: each rank reads what its chunks need, and a V schedule
    ends on rank 0.
    """

    def __init__(self, workload: Workload, options: dict[str, Any]) -> None:
        self.x, self.y = workload.batch()
        self.pipe = Pipe(workload.build(), loss_fn=workload.loss(), sample=Sample(self.x, self.y),
                         group=dist.group.WORLD, timeout=TIMEOUT, **options)

    def step(self) -> None:
        self.pipe.zero_grad()
        self.pipe.step(self.x, self.y)

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pipe.parameters())

    def close(self) -> None:
        self.pipe.close()


class TorchPipelining(TorchStage):
    """torch.distributed.pipelining: this rank's layers of ``balance`` in a PipelineStage.

    A weight two stages share (the GPT's tied embedding and head) becomes two weights, since
    torch's stages do not add their gradients; ours do.
    """

    def __init__(self, workload: Workload, rank: int, balance: Sequence[int],
                 microbatches: int, schedule: str) -> None:
        first = sum(balance[:rank])
        layers = copy.deepcopy(workload.build()[first:first + balance[rank]])
        super().__init__(layers, rank, microbatches, schedule, workload.loss(), workload.batch())

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class MemoryCase:
    """Peaks are per stage, measured: 2 x parameter bytes + the worst step's activations."""

    never: Predicted  # 1F1B at REFERENCE_M, no recomputation (the grid's cut)
    never_peak: tuple[float, ...]
    always: Predicted  # the same with full recomputation
    always_peak: tuple[float, ...]
    limit: float
    rule: str  # how the limit was set
    pick: Predicted | None  # None: planning failed (error)
    pick_peak: tuple[float, ...] = ()
    always_in_plan: float | None = None  # the limited plan's own 1F1B+always step, if it has one
    plan_seconds: float = 0.0
    error: str | None = None
    spans: list[list[Span]] = field(default_factory=list)  # [the pick, 1F1B+always] steps


@dataclass(frozen=True)
class ModelReport:
    """What one rank measured of one model (and, on every rank, what rank 0 planned)."""

    name: str
    hop: tuple[float, float]  # the grid's hop: latency s, bandwidth B/s
    plan_seconds: tuple[float, float]  # the grid's plan, the auto Pipe's construction
    rows: list[Predicted]  # the auto pick, the auto plan's others the grid lacks, the grid
    ours: list[list[Span]]  # per row, this rank's steps after the warm-up
    torch_runs: list[tuple[str, int]]  # (schedule, M) of each torch runner
    torch_balance: tuple[int, ...]
    torch: list[list[Span]]
    memory: MemoryCase | None  # None: the grid has no 1F1B at REFERENCE_M


# -- measuring --------------------------------------------------------------------------------


def timed_step(step: Callable[[], None]) -> Span:
    """One step on this rank, from a barrier that starts every rank together."""
    dist.barrier()
    start = time.perf_counter()
    step()
    return start, time.perf_counter()


def round_robin(runners: Sequence[Any], steps: int) -> list[list[Span]]:
    """One warm-up round, then ``steps`` rounds, each runner one step per round.

    Each round starts one runner further on, so that no runner is always the one after a
    round's turn-over; the order is the same on every rank, as the steps must be.
    """
    spans: list[list[Span]] = [[] for _ in runners]
    for round_index in range(steps + 1):
        for turn in range(len(runners)):
            index = (round_index + turn) % len(runners)
            span = timed_step(runners[index].step)
            if round_index:
                spans[index].append(span)
    return spans


def measured_peak(workload: Workload, options: dict[str, Any]) -> tuple[float, ...]:
    """Per stage (on every rank): 2 x its parameter bytes plus the most activation bytes it
    held in PEAK_STEPS steps inside ``pipe.measure_memory()``."""
    runner = OurPipe(workload, options)
    activations = 0
    for _ in range(PEAK_STEPS):
        with runner.pipe.measure_memory():
            timed_step(runner.step)
        activations = max(activations, runner.pipe.memory[0].peak_bytes)
    mine = float(activations + 2 * runner.parameter_bytes())  # before close: then it holds none
    runner.close()
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return tuple(every)


def choose_limit(never_peak: Sequence[float], leanest: float) -> tuple[float, str]:
    """LIMIT_SHARE of 1F1B's measured peak; where no plan is predicted to fit that, midway
    between it and the leanest plan's predicted peak; where none is predicted more than
    HEADROOM below it (a midway limit would then sit within the memory model's error of
    1F1B's own peak, and fit or not by bytes), just below it: the planner then says what
    the smallest limit it can meet is."""
    top = max(never_peak)
    if LIMIT_SHARE * top >= leanest:
        return LIMIT_SHARE * top, f"{LIMIT_SHARE:.0%} of it"
    lean = f"the leanest plan is predicted at {leanest / 2**20:.2f} MiB"
    if leanest < (1 - HEADROOM) * top:
        return (leanest + top) / 2, f"midway to the leanest plan: {lean}"
    return JUST_BELOW * top, (f"{JUST_BELOW:.0%} of it: {lean}, none {HEADROOM:.0%} below "
                              f"1F1B's peak")


def memory_case(workload: Workload, grid: Grid, steps: int) -> MemoryCase | None:
    """1F1B's and 1F1B+always's peaks, the limit, the auto pick under it: its peak, and its
    step time round-robin against 1F1B+always's."""
    never = grid_entry(grid.plan, "1f1b", REFERENCE_M, "never")
    always = grid_entry(grid.plan, "1f1b", REFERENCE_M, "always")
    if never is None or always is None:
        return None
    case = MemoryCase(never, measured_peak(workload, never.options), always,
                      measured_peak(workload, always.options), 0.0, "", None)
    limit, rule = choose_limit(case.never_peak, grid.leanest)
    case = replace(case, limit=limit, rule=rule)
    start = time.perf_counter()
    try:
        auto = OurPipe(workload, {"chunks": "auto", "schedule": "auto", "checkpoint": "auto",
                                  "memory_limit": limit})
    except ValueError as error:  # every rank: rank 0's planning error reaches them all
        return replace(case, error=str(error))
    own = grid_entry(auto.pipe.plan, "1f1b", REFERENCE_M, "always")
    case = replace(case, pick=predicted(auto.pipe.plan, "auto pick"),
                   always_in_plan=None if own is None else own.step_time,
                   plan_seconds=time.perf_counter() - start)
    case = replace(case, pick_peak=measured_peak(workload, auto.pipe.plan.pipe_options()))
    runners = [auto, OurPipe(workload, always.options)]
    spans = round_robin(runners, steps)
    for runner in runners:
        runner.close()
    return replace(case, spans=spans)


def measure_model(workload: Workload, rank: int, steps: int) -> ModelReport:
    """Everything one rank measures of one model; every rank runs the same runners in the
    same order."""
    hop = calibrated_hop()
    start = time.perf_counter()
    grid = grid_plan(workload, hop)
    middle = time.perf_counter()
    auto = OurPipe(workload, {"chunks": "auto", "schedule": "auto", "checkpoint": "never"})
    seconds = (middle - start, time.perf_counter() - middle)
    rows = table_rows(auto.pipe.plan, grid.plan)
    ours = [auto, *(OurPipe(workload, row.options) for row in rows[1:])]
    balance = torch_balance(rows)
    torch_runs = [(name, m) for name in TORCH_SCHEDULES for m in COUNTS]
    theirs = [TorchPipelining(workload, rank, balance, m, name) for name, m in torch_runs]
    spans = round_robin([*ours, *theirs], steps)
    for runner in ours:
        runner.close()
    del ours, theirs
    return ModelReport(workload.name, (hop.latency, hop.bandwidth), seconds, rows,
                       spans[:len(rows)], torch_runs, balance, spans[len(rows):],
                       memory_case(workload, grid, steps))


def rank_main(rank: int, world: int, names: Sequence[str], steps: int) -> list[ModelReport]:
    """Each named model in turn, on one torch thread."""
    from pipeline import keep_freed_pages

    torch.set_num_threads(1)
    keep_freed_pages()  # host memory kept between actions, as a GPU's caching allocator keeps it
    return [measure_model(WORKLOADS[name], rank, steps) for name in names]

