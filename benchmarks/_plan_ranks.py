"""bench_plan --ranks 2: the plan's pick against every candidate and torch's, on gloo ranks.

Each rank builds examples/models.py's uneven MLP (seeded, so alike everywhere), a
256-row batch and a hop calibrated by ping-pong over the group; rank 0 profiles and
plans, every rank gets the plan. Then every candidate runs as a ``Pipe`` over the
group, and torch.distributed.pipelining's GPipe and 1F1B at the same Ms on the
pick's cut, all taking turns round after round (a barrier before each step) so that
others' load hits them alike. Last, a plan under a memory limit the unconstrained
pick does not fit runs with ``memory_report=True``. The parent prints the tables,
each step's time the slower rank's; a runner's figure is the median of its steps
that no burst of other processes overlapped (``_spawn.LoadMonitor``), or of all of
them where too few were quiet.

Rank 0 plans as ``plan_for_model`` does (each micro-batch size profiled, then
``plan``), but keeps the profiles, so that the memory-limited plan prices the same
costs: two profiles of one model differ by 10-40% on a busy machine, enough to move
cuts and picks between the two plans. The limit is LIMIT_SHARE of the pick's peak,
raised to the leanest candidate's peak where that is higher, so that a plan fits.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from _spawn import LoadMonitor, run_ranks
from examples.models import uneven_mlp
from partitioners import Plan, Profile, plan, profile
from pipeline import Pipe
from pipeline.calibration import action_overhead, calibrate_group
from pipeline.coordination import on_rank_zero
from schedules import Link, get_schedule

STAGES = 2
BATCH = 256
COUNTS = (4, 8, 16)
TORCH_SCHEDULES = ("gpipe", "1f1b")
LIMIT_SHARE = 0.8  # the memory case's limit: this share of the unconstrained pick's peak
MEMORY_STEPS = 3  # steps of the memory case (the first a warm-up)
TIMEOUT = 120.0
BAR = 1.05
QUIET_CORES = 0.25  # a step while others kept more cores than this busy is set aside

Span = tuple[float, float]  # one step on one rank: (start, end), time.perf_counter seconds


@dataclass(frozen=True)
class Predicted:
    """One plan candidate, as the parent needs it (a Plan holds read-only mappings)."""

    label: str
    microbatches: int
    balance: tuple[int, ...]
    step_time: float
    peak_memory: tuple[float, ...]
    description: str


@dataclass(frozen=True)
class MemoryCase:
    """The memory-limited plan's pick and what this rank's stage held running it."""

    limit: float
    unconstrained_peak: float  # the unconstrained pick's largest stage peak
    pick: Predicted
    activation_bytes: int  # saved activations at the peak (pipe.memory), the worst step
    parameter_bytes: int  # this stage's parameters; their gradients as much again
    step_times: list[float]


@dataclass(frozen=True)
class RankReport:
    """What one rank measured (and, on every rank, what rank 0 planned)."""

    hop: tuple[float, float]  # latency s, bandwidth B/s
    plan_seconds: float
    candidates: list[Predicted]  # the plan's ranking: the pick first
    ours: list[list[Span]]  # per candidate, this rank's steps after the warm-up
    torch_runs: list[tuple[str, int]]  # (schedule, M) of each torch runner
    torch_balance: tuple[int, ...]
    torch: list[list[Span]]
    memory: MemoryCase | None  # None: no limit excludes the pick and leaves a plan


# -- the model, the batch, the plan -----------------------------------------------------------


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return uneven_mlp()


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, 512, generator=generator),
            torch.randn(BATCH, 10, generator=generator))


def calibrated_hop(tries: int = 3) -> Link:
    """The gloo hop between the two ranks, by ping-pong (every rank calls this).

    The first calibration after the group starts often reads 1-2 ms where later ones read
    0.1-0.2 ms: the lowest latency of a few tries is the link (others' load only slows it).
    """
    probe = get_schedule("1f1b", STAGES, STAGES)
    links = [calibrate_group(dist.group.WORLD, probe, torch.device("cpu"), TIMEOUT).link(0, 1)
             for _ in range(tries)]
    return min(links, key=lambda link: link.latency)


def profiled_costs() -> Callable[[int], Profile]:
    """``plan_for_model``'s cost source, keeping each micro-batch size's profile."""
    model, (x, y) = build_model(), make_batch()
    found: dict[int, Profile] = {}

    def at(rows: int) -> Profile:
        if rows not in found:
            found[rows] = profile(model, x, progress=False, microbatch_size=rows,
                                  loss_fn=nn.MSELoss(), target=y)
        return found[rows]

    return at


def memory_limit_for(chosen: Plan) -> float | None:
    """LIMIT_SHARE of the pick's peak, at least the leanest candidate's; None if none is
    leaner than the pick."""
    pick = max(chosen.peak_memory)
    leanest = min(max(c.peak_memory) for c in chosen.candidates)
    return max(LIMIT_SHARE * pick, leanest) if leanest < pick else None


def plans_on_rank_zero(hop: Link) -> tuple[Plan, Plan | None]:
    """Rank 0 profiles the model and plans without a limit, then under one (from the same
    profiles); every rank gets both Plans."""

    def make() -> tuple[Plan, Plan | None]:
        costs = profiled_costs()
        options: dict[str, Any] = {"hop": hop, "microbatch_counts": COUNTS,
                                   "checkpoints": ["never"], "prune": False,
                                   "action_overhead": action_overhead(torch.device("cpu"))}
        chosen = plan(costs, STAGES, BATCH, **options)
        limit = memory_limit_for(chosen)
        limited = None if limit is None else plan(costs, STAGES, BATCH, limit, **options)
        return chosen, limited

    return on_rank_zero(make, dist.group.WORLD, TIMEOUT, "planning")  # type: ignore[no-any-return]


def schedule_label(candidate: Any) -> str:
    options = ",".join(f"{k}={v}" for k, v in candidate.schedule_options.items())
    return f"{candidate.schedule}({options})" if options else candidate.schedule


def predicted(candidate: Any) -> Predicted:
    return Predicted(schedule_label(candidate), candidate.microbatches, tuple(candidate.balance),
                     candidate.step_time, tuple(candidate.peak_memory), candidate.describe())


# -- the runners: one step per call -----------------------------------------------------------


class OurPipe:
    """Our Pipe over the group with one candidate's options (x and y on every rank: each
    rank reads what its chunks need, and a V schedule ends on rank 0)."""

    def __init__(self, options: dict[str, Any], memory_report: bool = False) -> None:
        self.pipe = Pipe(build_model(), loss_fn=nn.MSELoss(), group=dist.group.WORLD,
                         memory_report=memory_report, timeout=TIMEOUT, **options)
        self.x, self.y = make_batch()

    def step(self) -> None:
        self.pipe.zero_grad()
        self.pipe.step(self.x, self.y)

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pipe.parameters())


class TorchPipelining:
    """torch.distributed.pipelining: this rank's layers of ``balance`` in a PipelineStage."""

    def __init__(self, rank: int, balance: Sequence[int], microbatches: int, schedule: str) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        first = sum(balance[:rank])
        self.module = copy.deepcopy(build_model()[first:first + balance[rank]])
        stage = PipelineStage(self.module, rank, STAGES, torch.device("cpu"))
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        self.schedule = kind(stage, microbatches, loss_fn=nn.MSELoss())
        self.rank = rank
        self.x, self.y = make_batch()

    def step(self) -> None:
        self.module.zero_grad(set_to_none=True)
        if self.rank == 0:
            self.schedule.step(self.x)
        else:
            self.schedule.step(target=self.y, losses=[])


def torch_balance(candidates: Sequence[Predicted]) -> tuple[int, ...]:
    """The pick's cut, or, if the pick has several chunks per stage, the best one-chunk cut."""
    return next(c.balance for c in candidates if len(c.balance) == STAGES)


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


def memory_case(unconstrained: Plan, limited: Plan) -> MemoryCase:
    """The memory-limited pick run with memory_report=True: this stage's worst step."""
    assert limited.memory_limit is not None  # planned with one
    runner = OurPipe(limited.pipe_options(), memory_report=True)
    peaks, times = [], []
    for _ in range(MEMORY_STEPS):
        start, end = timed_step(runner.step)
        times.append(end - start)
        peaks.append(runner.pipe.memory[0].peak_bytes)
    parameter_bytes = runner.parameter_bytes()  # before close: then the Pipe holds none
    runner.pipe.close()
    return MemoryCase(limited.memory_limit, max(unconstrained.peak_memory), predicted(limited),
                      max(peaks), parameter_bytes, times[1:])


def rank_main(rank: int, world: int, steps: int) -> RankReport:
    """Everything one rank measures; every rank runs the same runners in the same order."""
    torch.set_num_threads(1)
    hop = calibrated_hop()
    start = time.perf_counter()
    chosen, limited = plans_on_rank_zero(hop)
    plan_seconds = time.perf_counter() - start
    candidates = [predicted(c) for c in chosen.candidates]
    ours = [OurPipe(c.pipe_options()) for c in chosen.candidates]
    balance = torch_balance(candidates)
    torch_runs = [(name, m) for name in TORCH_SCHEDULES for m in COUNTS]
    theirs = [TorchPipelining(rank, balance, m, name) for name, m in torch_runs]
    spans = round_robin([*ours, *theirs], steps)
    for runner in ours:
        runner.pipe.close()
    memory = None if limited is None else memory_case(chosen, limited)
    return RankReport((hop.latency, hop.bandwidth), plan_seconds, candidates, spans[:len(ours)],
                      torch_runs, balance, spans[len(ours):], memory)


# -- the parent: launch and print -------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    """One runner's step time: the median of its quiet steps (of all, if too few were)."""

    seconds: float
    quiet: int
    steps: int

    def note(self) -> str:
        """``"4/5"`` quiet steps, ``"1/5!"`` where too few were and every step counted."""
        return f"{self.quiet}/{self.steps}{'' if enough_quiet(self.quiet, self.steps) else '!'}"


def enough_quiet(quiet: int, steps: int) -> bool:
    return quiet >= min(steps, max(3, steps // 2))


def measure(per_rank: Sequence[list[list[Span]]], monitor: LoadMonitor) -> list[Measured]:
    """Per runner: a step's time is the slowest rank's; a step is quiet if other processes
    kept at most QUIET_CORES cores busy from its first rank's start to its last one's end."""
    found = []
    for runs in zip(*per_rank, strict=True):
        every, quiet = [], []
        for spans in zip(*runs, strict=True):
            seconds = max(end - start for start, end in spans)
            every.append(seconds)
            busy = monitor.busy_between(min(s for s, _ in spans), max(e for _, e in spans))
            if busy <= QUIET_CORES:
                quiet.append(seconds)
        chosen = quiet if enough_quiet(len(quiet), len(every)) else every
        found.append(Measured(statistics.median(chosen), len(quiet), len(every)))
    return found


def fastest(measured: Sequence[Measured]) -> int:
    return min(range(len(measured)), key=lambda index: measured[index].seconds)


def print_candidates(report: RankReport, measured: Sequence[Measured]) -> None:
    print(f"{'#':>2} {'schedule':<38} {'M':>3}  {'balance':<14} {'predicted ms':>12} "
          f"{'measured ms':>11} {'meas/pred':>9} {'quiet':>6}")
    for index, (c, found) in enumerate(zip(report.candidates, measured, strict=True)):
        print(f"{index + 1:>2} {c.label:<38} {c.microbatches:>3}  {str(list(c.balance)):<14} "
              f"{c.step_time * 1e3:>12.1f} {found.seconds * 1e3:>11.1f} "
              f"{found.seconds / c.step_time:>9.2f} {found.note():>6}")
    print(f"(ranked by prediction, the pick first; measured: the median of the quiet steps, a "
          f"step's time the slower rank's from a barrier; quiet: steps during which other "
          f"processes kept at most {QUIET_CORES} cores busy, '!': too few, all steps counted)")


def print_pick(report: RankReport, measured: Sequence[Measured]) -> None:
    pick, best = report.candidates[0], fastest(measured)
    ratio = measured[0].seconds / measured[best].seconds
    print(f"\npick: {pick.description}: predicted {pick.step_time * 1e3:.1f} ms, measured "
          f"{measured[0].seconds * 1e3:.1f} ms")
    print(f"best measured: {report.candidates[best].description}: "
          f"{measured[best].seconds * 1e3:.1f} ms")
    print(f"pick / best measured = {ratio:.3f}: {'within' if ratio <= BAR else 'NOT within'} 5%")


def print_torch(report: RankReport, theirs: Sequence[Measured],
                ours: Sequence[Measured]) -> None:
    print(f"\ntorch.distributed.pipelining (PipelineStage), balance {list(report.torch_balance)}:")
    print(f"{'schedule':<8} {'M':>3} {'torch ms':>9} {'quiet':>6} {'ours ms':>8} "
          f"{'ours/torch':>10}")
    for (name, m), found in zip(report.torch_runs, theirs, strict=True):
        same = [mine.seconds for c, mine in zip(report.candidates, ours, strict=True)
                if (c.label, c.microbatches, c.balance) == (name, m, report.torch_balance)]
        versus = (f"{same[0] * 1e3:>8.1f} {same[0] / found.seconds:>10.3f}" if same
                  else f"{'-':>8} (ours at this M used another cut)")
        print(f"{name:<8} {m:>3} {found.seconds * 1e3:>9.1f} {found.note():>6} {versus}")
    best = fastest(theirs)
    name, m = report.torch_runs[best]
    print(f"ours pick / torch best ({name}, M={m}, {theirs[best].seconds * 1e3:.1f} ms) = "
          f"{ours[0].seconds / theirs[best].seconds:.3f}")


def print_memory(cases: Sequence[MemoryCase | None]) -> None:
    if cases[0] is None:
        print("\nmemory limit: none, the pick is already the leanest candidate")
        return
    known = [c for c in cases if c is not None]
    case, mib = known[0], 2.0 ** 20
    seconds = statistics.median(max(s) for s in zip(*(c.step_times for c in known), strict=True))
    print(f"\nmemory limit {case.limit / mib:.2f} MiB per stage "
          f"({case.limit / case.unconstrained_peak:.0%} of the unconstrained pick's "
          f"{case.unconstrained_peak / mib:.2f} MiB; {LIMIT_SHARE:.0%}, or the leanest "
          f"candidate's peak if higher): pick {case.pick.description}, predicted "
          f"{case.pick.step_time * 1e3:.1f} ms, measured {seconds * 1e3:.1f} ms (with "
          f"memory_report's hooks)")
    print(f"{'stage':>5} {'predicted MiB':>13} {'measured MiB':>12} {'activations pred':>16} "
          f"{'activations meas':>16} {'meas <= limit':>13}")
    for stage, rank_case in enumerate(known):
        fixed = 2 * rank_case.parameter_bytes
        total = fixed + rank_case.activation_bytes
        peak = case.pick.peak_memory[stage]
        print(f"{stage:>5} {peak / mib:>13.2f} {total / mib:>12.2f} "
              f"{(peak - fixed) / mib:>16.2f} {rank_case.activation_bytes / mib:>16.2f} "
              f"{'yes' if total <= case.limit else 'NO':>13}")
    print("(MiB: parameters and their gradients, 2 x parameter bytes, plus saved activations, "
          "predicted by the simulator, measured by pipe.memory's saved-tensor hooks, the worst "
          "of the steps)")


def run(steps: int) -> None:
    """Launch the two ranks and print what they measured."""
    print(f"2. uneven MLP (examples/models.py: 13 layers, 7 Linear + 6 ReLU, 512 wide with one "
          f"4096-wide pair), batch {BATCH}, on {STAGES} gloo ranks, one torch thread each; "
          f"load average {os.getloadavg()[0]:.2f} before")
    started = time.perf_counter()
    with LoadMonitor() as monitor:
        reports: list[RankReport] = run_ranks(rank_main, STAGES, steps, timeout=900.0)
    first = reports[0]
    latency, bandwidth = first.hop
    print(f"hop (gloo ping-pong): {latency * 1e6:.0f} us + bytes / {bandwidth / 1e9:.2f} GB/s; "
          f"rank 0 profiled and planned (twice) in {first.plan_seconds:.1f} s; "
          f"{len(first.candidates)} candidates, all run ({steps} steps each after a warm-up "
          f"round, round-robin)")
    ours = measure([r.ours for r in reports], monitor)
    print_candidates(first, ours)
    print_pick(first, ours)
    print_torch(first, measure([r.torch for r in reports], monitor), ours)
    print_memory([r.memory for r in reports])
    print(f"\n{time.perf_counter() - started:.0f} s; other processes kept {monitor.mean():.2f} "
          f"of {os.cpu_count()} cores busy on average; load average {os.getloadavg()[0]:.2f} "
          f"after")
