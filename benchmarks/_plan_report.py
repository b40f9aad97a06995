"""bench_plan --ranks 2, the parent: launch the ranks, then per model the tables and the bar.

Each step's time is the slower rank's from a barrier; a runner's figure is the median of
its steps that no burst of other processes overlapped (``_spawn.LoadMonitor``), or of
all of them where too few were quiet. The bar (issue 13), per model: the auto pick
within BAR of the best of the grid (every schedule x M in COUNTS; also shown: of the best
of everything measured), faster than torch.distributed.pipelining's best, and under a
memory limit below 1F1B's peak at M=8, a pick that fits (measured) and is faster than
1F1B with full recomputation.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from _plan_grid import Predicted
from _plan_ranks import REFERENCE_M, MemoryCase, ModelReport, Span, rank_main
from _plan_workloads import COUNTS, STAGES, WORKLOADS
from _spawn import LoadMonitor, run_ranks

BAR = 1.05
QUIET_CORES = 0.25  # a step while others kept more cores than this busy is set aside
MIB = 2.0**20


@dataclass(frozen=True)
class Measured:
    """One runner's step time: the median of its quiet steps (of all, if too few were)."""

    seconds: float
    quiet: int
    steps: int

    def note(self) -> str:
        """``"4/5"`` quiet steps, ``"1/5!"`` where too few were and every step counted."""
        return f"{self.quiet}/{self.steps}{'' if enough_quiet(self.quiet, self.steps) else '!'}"


@dataclass(frozen=True)
class Verdicts:
    """One model's answers to the bar; None where the run could not tell."""

    within_grid: float  # the pick / the best of the grid (every schedule x M in COUNTS)
    within: float  # the pick / the best other configuration measured (the grid and more)
    versus_torch: float  # the pick / torch's best
    fits: bool | None  # None: no pick under the limit
    versus_always: float | None  # the memory pick / 1F1B+always


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


def fastest(measured: Sequence[Measured], among: Sequence[int]) -> int:
    return min(among, key=lambda index: measured[index].seconds)


def yes(flag: bool | None) -> str:
    return "n/a" if flag is None else "yes" if flag else "NO"


# -- the tables -------------------------------------------------------------------------------


def print_rows(rows: Sequence[Predicted], measured: Sequence[Measured]) -> None:
    print(f"{'#':>2} {'source':<9} {'schedule':<36} {'M':>3}  {'balance':<14} "
          f"{'predicted ms':>12} {'measured ms':>11} {'meas/pred':>9} {'quiet':>6}")
    for index, (row, found) in enumerate(zip(rows, measured, strict=True)):
        print(f"{index + 1:>2} {row.source:<9} {row.label:<36} {row.microbatches:>3}  "
              f"{str(list(row.balance)):<14} {row.step_time * 1e3:>12.1f} "
              f"{found.seconds * 1e3:>11.1f} {found.seconds / row.step_time:>9.2f} "
              f"{found.note():>6}")
    counts = ", ".join(map(str, COUNTS))
    print(f"(auto pick: Pipe(chunks='auto', schedule='auto', checkpoint='never') itself, "
          f"predicted by its own plan; auto: its plan's other candidates the grid lacks; "
          f"grid: every schedule x M in {{{counts}}} with the planner's cut by time, ranked "
          f"by the grid plan's prediction; measured: the median of the quiet steps, a step's "
          f"time the slower rank's from a barrier; quiet: steps during which other processes "
          f"kept at most {QUIET_CORES} cores busy, '!': too few, all steps counted)")


def print_pick(rows: Sequence[Predicted], measured: Sequence[Measured]) -> tuple[float, float]:
    """The pick against the best of the grid, and against the best other configuration."""
    others = range(1, len(rows))
    grid = [i for i in others if rows[i].source == "grid"]
    best, best_grid = fastest(measured, others), fastest(measured, grid)
    pick = measured[0].seconds
    print(f"\npick: {rows[0].description}: predicted {rows[0].step_time * 1e3:.1f} ms, "
          f"measured {pick * 1e3:.1f} ms")
    for label, index in (("of the grid", best_grid), ("of everything else", best)):
        ratio = pick / measured[index].seconds
        print(f"best {label} (#{index + 1}): {rows[index].description}: "
              f"{measured[index].seconds * 1e3:.1f} ms; pick / best = {ratio:.3f}: "
              f"{'within' if ratio <= BAR else 'NOT within'} 5%")
    return pick / measured[best_grid].seconds, pick / measured[best].seconds


def print_torch(report: ModelReport, theirs: Sequence[Measured],
                ours: Sequence[Measured]) -> float:
    """torch's runs beside ours at the same schedule, M and cut; the pick / torch's best."""
    print(f"\ntorch.distributed.pipelining (PipelineStage), balance {list(report.torch_balance)}:")
    print(f"{'schedule':<8} {'M':>3} {'torch ms':>9} {'quiet':>6} {'ours ms':>8} "
          f"{'ours/torch':>10}")
    for (name, m), found in zip(report.torch_runs, theirs, strict=True):
        same = [mine.seconds for row, mine in zip(report.rows[1:], ours[1:], strict=True)
                if (row.label, row.microbatches, row.balance) == (name, m, report.torch_balance)]
        versus = (f"{same[0] * 1e3:>8.1f} {same[0] / found.seconds:>10.3f}" if same
                  else f"{'-':>8} (ours at this M used another cut)")
        print(f"{name:<8} {m:>3} {found.seconds * 1e3:>9.1f} {found.note():>6} {versus}")
    best = fastest(theirs, range(len(theirs)))
    name, m = report.torch_runs[best]
    ratio = ours[0].seconds / theirs[best].seconds
    print(f"ours pick / torch best ({name}, M={m}, {theirs[best].seconds * 1e3:.1f} ms) = "
          f"{ratio:.3f}: {'faster' if ratio < 1 else 'NOT faster'}")
    return ratio


def print_peaks(case: MemoryCase) -> None:
    print(f"{'run':<34} {'predicted MiB per stage':>24} {'measured MiB per stage':>23} "
          f"{'fits':>5}")
    runs = [(f"1f1b, M={REFERENCE_M}, checkpoint never", case.never, case.never_peak),
            (f"1f1b, M={REFERENCE_M}, checkpoint always", case.always, case.always_peak)]
    if case.pick is not None:
        runs.append(("the pick under the limit", case.pick, case.pick_peak))
    for label, row, peaks in runs:
        predicted = " ".join(f"{p / MIB:6.2f}" for p in row.peak_memory)
        found = " ".join(f"{p / MIB:6.2f}" for p in peaks)
        fits = yes(max(peaks) <= case.limit)
        print(f"{label:<34} {predicted:>24} {found:>23} {fits:>5}")
    print("(parameters and their gradients, 2 x parameter bytes, plus saved activations: "
          "predicted by the simulator, measured by pipe.memory's saved-tensor hooks, the "
          "worst of the steps; fits: measured, every stage within the limit)")


def print_memory(cases: Sequence[MemoryCase | None],
                 monitor: LoadMonitor) -> tuple[bool | None, float | None]:
    """The memory case's peaks, limit and times (each rank's case: its steps); (the pick
    fits, None where there is none; pick / 1F1B+always)."""
    case = cases[0]
    if case is None:
        print(f"\nmemory limit: none (the grid has no 1F1B at M={REFERENCE_M})")
        return None, None
    print(f"\nmemory limit {case.limit / MIB:.2f} MiB per stage, "
          f"{case.limit / max(case.never_peak):.1%} of 1F1B M={REFERENCE_M}'s measured peak "
          f"{max(case.never_peak) / MIB:.2f} MiB (set to {case.rule})")
    if case.pick is None:
        print(f"the auto Pipe found no plan: {case.error}")
        print_peaks(case)
        return None, None
    fits = max(case.pick_peak) <= case.limit
    pick, always = measure([c.spans for c in cases if c is not None], monitor)
    ratio = pick.seconds / always.seconds
    own = "-" if case.always_in_plan is None else f"{case.always_in_plan * 1e3:.1f}"
    print(f"pick (planned in {case.plan_seconds:.1f} s): {case.pick.description}")
    print_peaks(case)
    print(f"step: pick {pick.seconds * 1e3:.1f} ms ({pick.note()}, predicted "
          f"{case.pick.step_time * 1e3:.1f}), 1F1B M={REFERENCE_M} checkpoint always "
          f"{always.seconds * 1e3:.1f} ms ({always.note()}, predicted "
          f"{case.always.step_time * 1e3:.1f} by the grid, {own} by the limited plan); "
          f"pick / 1F1B+always = {ratio:.3f}: {'faster' if ratio < 1 else 'NOT faster'}")
    return fits, ratio


def print_model(reports: Sequence[ModelReport], monitor: LoadMonitor, steps: int) -> Verdicts:
    first = reports[0]
    latency, bandwidth = first.hop
    grid_seconds, auto_seconds = first.plan_seconds
    print(f"\n== {first.name}: {WORKLOADS[first.name].title}")
    print(f"grid hop (gloo ping-pong): {latency * 1e6:.0f} us + bytes / {bandwidth / 1e9:.2f} "
          f"GB/s; grid profiled and planned in {grid_seconds:.1f} s, the auto Pipe built "
          f"(calibration, profiles, plan) in {auto_seconds:.1f} s; {len(first.rows)} runs of "
          f"ours and {len(first.torch_runs)} of torch's, {steps} steps each after a warm-up "
          f"round, round-robin")
    ours = measure([r.ours for r in reports], monitor)
    print_rows(first.rows, ours)
    within_grid, within = print_pick(first.rows, ours)
    versus_torch = print_torch(first, measure([r.torch for r in reports], monitor), ours)
    fits, versus_always = print_memory([r.memory for r in reports], monitor)
    return Verdicts(within_grid, within, versus_torch, fits, versus_always)


def print_summary(verdicts: dict[str, Verdicts]) -> None:
    counts = ", ".join(map(str, COUNTS))
    print(f"\n== the bar (issue 13), per model (within 5%: of the grid's best, every schedule x "
          f"M in {{{counts}}}, the bar's letter; in brackets, of the best of everything "
          f"measured, the auto plan's other Ms and cuts too)")
    for name, v in verdicts.items():
        fits = "NO (no plan)" if v.fits is None else yes(v.fits)
        faster = "n/a" if v.versus_always is None else (
            f"{yes(v.versus_always < 1)} ({v.versus_always:.3f})")
        print(f"{name}: pick within 5%: {yes(v.within_grid <= BAR)} ({v.within_grid:.3f}) "
              f"[{yes(v.within <= BAR)} ({v.within:.3f})] | faster than torch's best: "
              f"{yes(v.versus_torch < 1)} ({v.versus_torch:.3f}) | memory pick fits: {fits}, "
              f"faster than 1F1B+always: {faster}")


def run(names: Sequence[str], steps: int) -> None:
    """Launch the two ranks, measure every model in ``names``, print the tables."""
    print(f"2. on {STAGES} gloo ranks, one torch thread each: {', '.join(names)}; load "
          f"average {os.getloadavg()[0]:.2f} before")
    started = time.perf_counter()
    with LoadMonitor() as monitor:
        per_rank: list[list[ModelReport]] = run_ranks(rank_main, STAGES, list(names), steps,
                                                      timeout=900.0)
    verdicts = {reports[0].name: print_model(reports, monitor, steps)
                for reports in zip(*per_rank, strict=True)}
    print_summary(verdicts)
    print(f"\n{time.perf_counter() - started:.0f} s; other processes kept {monitor.mean():.2f} "
          f"of {os.cpu_count()} cores busy on average; load average {os.getloadavg()[0]:.2f} "
          f"after")
