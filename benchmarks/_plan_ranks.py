"""bench_plan --ranks 2, on the ranks: each model's auto pick, grid, torch runs and memory case.

Per model (WORKLOADS: the uneven MLP, a small GPT; seeded, so alike on every rank), on
two gloo ranks; a runner is one configuration that takes a step per call, ours
(``OurPipe``) or torch's (``TorchPipelining``):

- the grid: rank 0 profiles the model (each micro-batch size, with the loss) and runs
  ``partitioners.plan`` over every schedule x M in COUNTS without pruning, so that every
  configuration has a cut by time and a prediction (and, over the auto Pipe's space,
  for the leanest plan's peak); every rank gets the plan;
- the pick: ``Pipe(chunks="auto", schedule="auto", checkpoint="never", sample=x)``, the
  real auto path (rank 0 profiles without a loss target and plans with its own hop and
  per-action overhead calibration, every rank runs the pick); its other candidates that
  the grid lacks (other Ms, other cuts) are measured too;
- torch.distributed.pipelining's GPipe and 1F1B at COUNTS on our pick's cut (or the
  best-ranked one-chunk cut when the pick has more chunks per stage).

Every one of them runs round-robin (a barrier before each step, one warm-up round) so
that others' load hits them alike. Then the memory case: 1F1B at M=8 without and with
full recomputation run once with ``memory_report=True`` for their peaks (2 x parameter
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
from torch import nn

from bench_vs_torch import TorchStage
from examples.gpt import gpt, lm_loss
from examples.models import uneven_mlp
from partitioners import MemoryLimitError, Plan, Profile, plan, profile
from pipeline import Pipe
from pipeline.calibration import action_overhead, calibrate_group
from pipeline.coordination import on_rank_zero
from schedules import Link, get_schedule

STAGES = 2
TIMEOUT = 120.0
COUNTS = (4, 8, 16)
GPT_VOCAB, GPT_SEQ = 256, 32
TORCH_SCHEDULES = ("gpipe", "1f1b")
LIMIT_SHARE = 0.8  # the memory limit: this share of 1F1B's measured peak at M=8
REFERENCE_M = 8  # the memory case's 1F1B
JUST_BELOW = 0.99  # the limit's share of 1F1B's peak where no plan is predicted below it
HEADROOM = 0.01  # a leanest plan less far below 1F1B's peak counts as none below it
PEAK_STEPS = 2  # steps of each memory_report run (the worst counts)

Span = tuple[float, float]  # one step on one rank: (start, end), time.perf_counter seconds
Batch = tuple[torch.Tensor, torch.Tensor]  # (input, target)


# -- the workloads and the runners ------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """A model, its batch and its loss; each call builds them afresh (a Pipe over a group
    takes its model apart)."""

    name: str
    title: str
    rows: int
    model: Callable[[], nn.Sequential]
    batch: Callable[[], Batch]
    loss: Callable[[], nn.Module]

    def build(self) -> nn.Sequential:
        torch.manual_seed(0)
        return self.model()


def _mlp_batch() -> Batch:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(256, 512, generator=generator), torch.randn(256, 10, generator=generator)


def _gpt_model() -> nn.Sequential:
    return gpt(GPT_VOCAB, dim=128, layers=6, heads=4, seq=GPT_SEQ, dropout=0.1, drop_path=0.0)


def _gpt_batch() -> Batch:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, GPT_VOCAB, (32, GPT_SEQ + 1), generator=generator)
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()


WORKLOADS = {
    "mlp": Workload("mlp", "uneven MLP (examples/models.py: 13 layers, 7 Linear + 6 ReLU, 512 "
                    "wide with one 4096-wide pair), batch 256, MSE loss", 256,
                    uneven_mlp, _mlp_batch, nn.MSELoss),
    "gpt": Workload("gpt", f"small GPT (examples/gpt.py: embedding, 6 blocks of width 128 with "
                    f"4 heads, LayerNorm, tied head; 9 layers), vocabulary {GPT_VOCAB}, batch 32 "
                    f"x {GPT_SEQ} tokens, dropout 0.1, cross-entropy", 32,
                    _gpt_model, _gpt_batch, lm_loss),
}


class OurPipe:
    """Our Pipe over the group with ``options`` (a candidate's ``pipe_options()``, or
    ``chunks="auto"`` and friends: then rank 0 plans from the batch, ``sample``).

    x and y live on every rank: each rank reads what its chunks need, and a V schedule
    ends on rank 0.
    """

    def __init__(self, workload: Workload, options: dict[str, Any],
                 memory_report: bool = False) -> None:
        self.x, self.y = workload.batch()
        self.pipe = Pipe(workload.build(), loss_fn=workload.loss(), sample=self.x,
                         sample_target=self.y, group=dist.group.WORLD,
                         memory_report=memory_report, timeout=TIMEOUT, **options)

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


# -- planning ---------------------------------------------------------------------------------


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

    found, leanest = on_rank_zero(make, dist.group.WORLD, TIMEOUT, "planning")
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
    held in PEAK_STEPS steps with ``memory_report=True``."""
    runner = OurPipe(workload, options, memory_report=True)
    activations = 0
    for _ in range(PEAK_STEPS):
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
    torch.set_num_threads(1)
    return [measure_model(WORKLOADS[name], rank, steps) for name in names]

