"""bench_plan --ranks 2, planning on the ranks: the gloo hop, rank 0's grid plan, the rows.

- the hop: the lowest-latency of a few ping-pong calibrations between the two ranks;
- the grid: rank 0 profiles the model (each micro-batch size, with the loss) and runs
  ``partitioners.plan`` over every schedule x M in COUNTS without pruning, so that every
  configuration has a cut by time and a prediction (and, over the auto Pipe's space,
  for the leanest plan's peak); every rank gets the plan;
- the rows (``Predicted``, what the parent needs of a candidate): the auto pick, its
  plan's other candidates the grid lacks, then the grid's; torch's cut is the pick's, or
  the best-ranked one-chunk cut when the pick has more chunks per stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from _plan_workloads import COUNTS, STAGES, TIMEOUT, Workload
from partitioners import MemoryLimitError, Plan, Profile, plan, profile
from pipeline.group.links import calibrate_group
from pipeline.group.ranks import RankGroup
from pipeline.predict.overheads import action_overhead
from schedules import Link, get_schedule


@dataclass(frozen=True)
class Predicted:
    """One configuration as the parent needs it (a Plan holds read-only mappings)."""

    source: str  # "auto pick", "auto" (another candidate of the auto plan) or "grid"
    label: str
    microbatches: int
    balance: tuple[int, ...]
    checkpoint: str
    step_time: float
    peak_memory: tuple[float, ...]
    description: str
    options: dict[str, Any] = field(compare=False)  # the candidate's pipe_options()

    @property
    def key(self) -> tuple[Any, ...]:
        return self.label, self.microbatches, self.balance, self.checkpoint


def calibrated_hop(tries: int = 3) -> Link:
    """The gloo hop between the two ranks, by ping-pong (every rank calls this).

    The first calibration after the group starts often reads 1-2 ms where later ones read
    0.1-0.2 ms: the lowest latency of a few tries is the link (others' load only slows it).
    """
    probe = get_schedule("1f1b", STAGES, STAGES)
    links = [calibrate_group(dist.group.WORLD, probe, torch.device("cpu"), TIMEOUT).link(0, 1)
             for _ in range(tries)]
    return min(links, key=lambda link: link.latency)


def profiled_costs(workload: Workload) -> Callable[[int], Profile]:
    """``plan_for_model``'s cost source (the loss included), one profile per size."""
    model, (x, y) = workload.build(), workload.batch()
    loss_fn = workload.loss()
    found: dict[int, Profile] = {}

    def at(rows: int) -> Profile:
        if rows not in found:
            found[rows] = profile(model, x, progress=False, microbatch_size=rows,
                                  loss_fn=loss_fn, target=y)
        return found[rows]

    return at


@dataclass(frozen=True)
class Grid:
    """Rank 0's plans from one profile of the model, on every rank."""

    plan: Plan  # every schedule x M in COUNTS, without and with full recomputation, unpruned
    leanest: float  # the smallest limit the auto Pipe's space can meet (any cut, recomputation)


def grid_plan(workload: Workload, hop: Link) -> Grid:
    """Rank 0 profiles the model and plans the grid, and the auto Pipe's space (its Ms, every
    checkpoint mode, cuts by time and under memory) for the smallest limit it can meet;
    every rank gets both."""

    def make() -> tuple[Plan, float]:  # what may cross ranks: the library's own classes
        costs = profiled_costs(workload)
        options: dict[str, Any] = {"hop": hop, "prune": False,
                                   "action_overhead": action_overhead(torch.device("cpu"))}
        grid = plan(costs, STAGES, workload.rows, microbatch_counts=COUNTS,
                    checkpoints=["never", "always"], **options)
        try:  # a limit nothing meets: the planner names the least it can meet
            plan(costs, STAGES, workload.rows, memory_limit=1, **options)
        except MemoryLimitError as error:
            return grid, float(error.smallest_limit)
        raise AssertionError("a plan fitted in one byte per stage")

    found, leanest = RankGroup(dist.group.WORLD, TIMEOUT).decide(make, "planning")
    return Grid(found, leanest)


def schedule_label(candidate: Any) -> str:
    options = ",".join(f"{k}={v}" for k, v in candidate.schedule_options.items())
    return f"{candidate.schedule}({options})" if options else candidate.schedule


def predicted(candidate: Any, source: str) -> Predicted:
    return Predicted(source, schedule_label(candidate), candidate.microbatches,
                     tuple(candidate.balance), candidate.checkpoint, candidate.step_time,
                     tuple(candidate.peak_memory), candidate.describe(),
                     candidate.pipe_options())


def table_rows(auto: Plan, grid: Plan) -> list[Predicted]:
    """The auto pick, the auto plan's other candidates the grid lacks, then the grid's runs
    without recomputation (ranked by its prediction)."""
    pick, *others = [predicted(c, "auto") for c in auto.candidates]
    rows = [predicted(c, "grid") for c in grid.candidates if c.checkpoint == "never"]
    known = {row.key for row in rows}
    return [replace(pick, source="auto pick"), *(r for r in others if r.key not in known), *rows]


def grid_entry(grid: Plan, schedule: str, microbatches: int, checkpoint: str) -> Predicted | None:
    """The best-ranked candidate of ``grid`` with this schedule, M and checkpoint mode."""
    return next((predicted(c, "grid") for c in grid.candidates
                 if (c.schedule, c.microbatches, c.checkpoint)
                 == (schedule, microbatches, checkpoint)), None)


def torch_balance(rows: Sequence[Predicted]) -> tuple[int, ...]:
    """The pick's cut, or, if the pick has several chunks per stage, the best one-chunk cut."""
    return next(row.balance for row in rows if len(row.balance) == STAGES)
