"""Measured step and bubble of each schedule on 2 gloo ranks, next to the simulator's prediction.

Run from the repository root (about a minute):

    python benchmarks/bench_schedules_measured.py
    python benchmarks/bench_schedules_measured.py --microbatches 16 --schedules 1f1b zb-h1

The balanced MLP of ``bench_vs_torch.py`` runs under each schedule with M
micro-batches and ``checkpoint="never"`` (so F, B, I and W are the passes
themselves, with no recomputation inside them). Per schedule, the steps that no
other process's burst overlapped give the measured step (median, barrier to
barrier) and the measured timeline (that of the median-makespan step). The
prediction replays the same Schedule with ``schedules.simulate``, fed with the
per-stage mean F, B, I and W durations of the measured timelines (a chunk's
action takes 1/v of a stage's cost in the simulator, v chunks per stage, so
per-chunk means are multiplied by v). ``pred+hop`` adds, as ``comm``, the mean
measured delay between a result's producer ending and its idle consumer starting
on the other rank: what the gap left after costs owes to communication.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from _rounds import QUIET_CORES, measure_rounds, timed_between_barriers
from _spawn import LoadMonitor, run_ranks
from _vs_torch_model import STAGES, make_batch, make_model

SCHEDULES = ("1f1b", "zb-h1", "interleaved-1f1b", "zb-v")


class Measured:
    """Our Pipe under one schedule; rank 0 keeps every step's measured Timeline."""

    def __init__(self, rank: int, microbatches: int, schedule: str) -> None:
        import torch.distributed as dist
        from torch import nn

        from pipeline import Pipe

        self.pipe = Pipe(make_model(), chunks=microbatches, schedule=schedule, checkpoint="never",
                         loss_fn=nn.MSELoss(), group=dist.group.WORLD)
        x, y = make_batch()
        placement = self.pipe.schedule.placement  # zb-v puts the last chunk back on stage 0
        self.x = x if placement[0] == rank else None
        self.y = y if placement[-1] == rank else None
        self.timelines: list[Any] = []

    def step(self) -> None:
        self.pipe.zero_grad()
        self.pipe.step(self.x, self.y)

    def after_step(self) -> None:
        """Outside the timed step: reading the timeline waits for its background gather."""
        self.timelines.append(self.pipe.timeline)


def rank_main(rank: int, world: int, microbatches: int, schedules: list[str], warmup: int,
              steps: int, rounds: int, seconds: float, load: Any) -> dict[str, Any]:
    """Per schedule: its Schedule, and each measured step's (start, end) and Timeline."""
    from pipeline import keep_freed_pages

    keep_freed_pages()  # host memory kept between actions, as a GPU's caching allocator keeps it
    runners = {name: Measured(rank, microbatches, name) for name in schedules}
    for runner in runners.values():
        for _ in range(warmup):
            timed_between_barriers(runner.step)
            runner.after_step()
        runner.timelines.clear()
    samples = measure_rounds(rank, runners, steps, rounds, seconds, load)
    if rank != 0:
        return {}
    return {name: {"schedule": runner.pipe.schedule, "steps": samples[name],
                   "timelines": runner.timelines}
            for name, runner in runners.items()}


# -- from measured timelines to simulator costs ----------------------------------------------


def stage_costs(timelines: list[Any]) -> dict[str, list[float | None] | None]:
    """Per-stage mean F, B, I and W costs (a whole stage's, as ``simulate`` takes them).

    A stage holding v chunks runs each action on 1/v of its layers; the simulator
    divides per-stage costs by v, so the per-chunk means are multiplied by v here.
    """
    first = timelines[0]
    costs: dict[str, list[float | None] | None] = {}
    for op in "FBIW":
        per_stage: list[float | None] = []
        for stage in range(first.stages):
            durations = [event.duration for timeline in timelines
                         for event in timeline.stage_events(stage) if event.action.op.value == op]
            per_stage.append(statistics.mean(durations) * first.chunks_per_stage[stage]
                             if durations else None)
        costs[op] = None if all(c is None for c in per_stage) else per_stage
    return costs


def predict(schedule: Any, costs: dict[str, list[float | None] | None], comm: float = 0.0) -> Any:
    """``simulate`` with the measured costs: B alone, or I and W when the backward is split.

    With a split backward a stage's unsplit ``B`` actions (if any) cost I + W there.
    """
    from schedules import simulate

    def known(op: str) -> list[float]:
        return [c if c is not None else 0.0 for c in (costs[op] or [None] * schedule.stages)]

    if costs["I"] is None:
        return simulate(schedule, forward=known("F"), backward=known("B"), comm=comm)
    return simulate(schedule, forward=known("F"), backward=known("I"), weight=known("W"),
                    comm=comm)


def hop_delay(timelines: list[Any], schedule: Any) -> float:
    """Mean delay from a producer's end to its consumer's start on another stage, counted
    only where the consumer had nothing else to do (it was idle, waiting): the mean, not
    the median, because the rare multi-millisecond hops are what the steps pay for."""
    from schedules import dependencies

    delays = []
    for timeline in timelines:
        by_key = {(e.action.op, e.action.microbatch, e.action.chunk): e for e in timeline.events}
        for stage in range(timeline.stages):
            events = timeline.stage_events(stage)
            for previous, event in zip(events, events[1:], strict=False):
                for needed in dependencies(schedule, event.action):
                    producer = by_key.get((needed.op, needed.microbatch, needed.chunk))
                    if producer is None or producer.stage == stage:
                        continue
                    if producer.end > previous.end:  # it waited for this result
                        delays.append(event.start - producer.end)
    return statistics.mean(delays) if delays else 0.0


# -- the table -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps per schedule per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds at least")
    parser.add_argument("--pin", action="store_true",
                        help="pin rank r (and its gloo threads) to core r")
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="keep measuring up to this long for enough quiet steps")
    args = parser.parse_args(argv)
    if args.pin:
        os.environ["PIPESCHED_PIN"] = "1"  # read by _spawn in each rank
    started = time.perf_counter()
    with LoadMonitor() as monitor:
        report = run_ranks(rank_main, STAGES, args.microbatches, args.schedules, args.warmup,
                           args.steps, args.rounds, args.seconds, monitor.latest)[0]
    print(f"P={STAGES} gloo ranks, M={args.microbatches}, MLP of bench_vs_torch.py, "
          "checkpoint='never'; ms, bubble = idle / (stages x makespan)")
    header = (f"{'schedule':<17} {'measured step':>13} {'makespan':>8} {'predicted':>9} "
              f"{'pred+hop':>8} | {'measured bubble':>15} {'predicted':>9} {'pred+hop':>8} | "
              f"{'hop':>5} {'quiet':>5}  per-stage costs F / B / I / W (ms)")
    print(header)
    print("-" * len(header))
    for name in args.schedules:
        entry = report[name]
        schedule = entry["schedule"]
        quiet = [i for i, (start, end) in enumerate(entry["steps"])
                 if monitor.busy_between(start, end) <= QUIET_CORES]
        kept = quiet if len(quiet) >= 3 else list(range(len(entry["steps"])))
        timelines = [entry["timelines"][i] for i in kept]
        step = 1e3 * statistics.median(entry["steps"][i][1] - entry["steps"][i][0] for i in kept)
        by_makespan = sorted(timelines, key=lambda t: t.makespan)
        median_timeline = by_makespan[len(by_makespan) // 2]
        costs = stage_costs(timelines)
        hop = hop_delay(timelines, schedule)
        predicted, with_hop = predict(schedule, costs), predict(schedule, costs, comm=hop)
        shown = " | ".join(
            "/".join("-" if c is None else f"{1e3 * c:.2f}"
                     for c in [(costs[op] or [None] * STAGES)[stage] for op in "FBIW"])
            for stage in range(STAGES)
        )
        print(f"{name:<17} {step:13.1f} {1e3 * median_timeline.makespan:8.1f} "
              f"{1e3 * predicted.makespan:9.1f} {1e3 * with_hop.makespan:8.1f} | "
              f"{median_timeline.bubble_fraction:15.3f} {predicted.bubble_fraction:9.3f} "
              f"{with_hop.bubble_fraction:8.3f} | {1e3 * hop:5.2f} "
              f"{len(quiet):>4}{'!' if len(quiet) < 3 else ' '}  {shown}")
    print("(measured step: barrier to barrier, with the step's own barrier, loss broadcast and "
          "timeline gather; makespan and measured bubble: the median-makespan step's timeline; "
          "hop: mean measured producer-end to waiting-consumer-start delay across ranks, fed "
          "to pred+hop as comm; quiet: steps free of others' load, '!' where too few and all "
          "counted)")
    print(f"other processes kept {monitor.mean():.2f} cores busy on average; "
          f"{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
