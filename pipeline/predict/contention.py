"""How much slower stages compute when they compute at the same time, and what that does to a step.

A chunk is probed alone (``pipeline.predict.probe``), but in a step the stages run at
once. On one GPU per rank that changes nothing; where ranks share cores (CPU
ranks on one host, or another job's load), every stage computes slower while
others compute too, and a prediction built from solo timings comes out short.
Stage threads in one process are not modelled: how long a thread waits for the
GIL varies from step to step by more than the effect (after a step, the
measured busy times refine a prediction instead).

The measure: each rank runs its chunks' forward and backward in a loop for a
fixed window, first alone (rank by rank), then all ranks at once; the ratio
of the two mean iteration times is the stage's factor when every stage
computes. The effect on a step: an action is slowed in proportion to how many
other stages compute while it runs, ``1 + (factor - 1) x others / (stages - 1)``,
averaged over the stage's busy time; that share comes from the simulated
timeline, so the costs and the timeline are iterated to a fixed point
(``contended``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import torch

from partitioners.measure.timing import synchronize
from schedules import Costs, Schedule, Timeline, simulate

from pipeline.compute.chunk import ChunkRunner
from pipeline.group.ranks import Ranks
from pipeline.predict.probe import ones_like_outputs, probe_runner, untouched

WINDOW = 0.08  # seconds each stage loops, alone and together (at least LEAST iterations)
LEAST = 2
NOTICEABLE = 0.03  # factors within 3% of 1 are taken as no contention
ROUNDS = 3  # costs <-> timeline iterations

ChunkWork = tuple[ChunkRunner, Any, Any]  # a chunk, its probe input and target (or None)


def loop_seconds(work: Sequence[ChunkWork], window: float, microbatches: int) -> float:
    """Mean seconds of one forward and backward of every chunk in ``work``, run in turn
    for ``window`` seconds (at least ``LEAST`` times). The model is left as it was."""
    with ExitStack() as stack:
        runners = []
        for chunk, inputs, target in work:
            stack.enter_context(untouched(chunk))
            runner = probe_runner(chunk, "never", tracked=False)
            runner.begin_step(0, microbatches)
            runners.append((runner, inputs, target))
        _one_pass(runners, 1)  # warm
        devices = {runner.device for runner, _, _ in runners}
        start = time.perf_counter()
        count = 0
        while count < LEAST or time.perf_counter() - start < window:
            count += 1
            _one_pass(runners, 2 * count + 1)
            for device in devices:
                synchronize(device)
        return (time.perf_counter() - start) / count


def _one_pass(runners: Sequence[ChunkWork], microbatch: int) -> None:
    for runner, inputs, target in runners:
        output = runner.forward(microbatch, inputs, target, 1.0)
        runner.backward(microbatch, ones_like_outputs(output, runner.spec.is_last))


def factor_across_ranks(work: Sequence[ChunkWork], microbatches: int, ranks: Ranks,
                        device: torch.device, window: float = WINDOW) -> tuple[float, str | None]:
    """This rank's loop time with every rank looping at once over its time alone (ranks
    take turns for that), and this rank's failure if its loop raised (the rank still takes
    part in every collective, so that no peer waits in vain). Every rank must call it."""
    failure: str | None = None

    def timed(seconds: float) -> float:
        nonlocal failure
        if not work or failure is not None:
            return 0.0
        try:
            return loop_seconds(work, seconds, microbatches)
        except Exception as error:
            failure = f"{type(error).__name__}: {error}"
            return 0.0

    window = max(ranks.gather(max(window, 2 * timed(0.0)),
                              "agreeing on predict()'s contention window", device))
    alone = 0.0
    for turn in range(ranks.size):
        ranks.gather(None, "timing each rank alone for predict()", device)  # a barrier
        if turn == ranks.rank:
            alone = timed(window)
    ranks.gather(None, "timing every rank at once for predict()", device)
    together = timed(window)
    return (together / alone if alone > 0 and together > 0 else 1.0), failure


def others_computing(timeline: Timeline) -> tuple[float, ...]:
    """Per stage, the mean number of other stages computing while it computes."""
    stages = timeline.stages
    edges: list[tuple[float, int, int]] = []
    for event in timeline.events:
        edges.append((event.start, 1, event.stage))
        edges.append((event.end, -1, event.stage))
    edges.sort(key=lambda edge: (edge[0], edge[1]))  # ends before starts at one instant
    running = [0] * stages
    total = 0
    weighted = [0.0] * stages
    busy = [0.0] * stages
    last = edges[0][0] if edges else 0.0
    for when, change, stage in edges:
        span = when - last
        if span > 0:
            for s in range(stages):
                if running[s]:
                    busy[s] += span
                    weighted[s] += span * (total - running[s])
        last = when
        running[stage] += change
        total += change
    return tuple(w / b if b > 0 else 0.0 for w, b in zip(weighted, busy))


def contended(costs: Costs, schedule: Schedule, factors: Sequence[float]
              ) -> tuple[Costs, Timeline]:
    """``costs`` slowed per stage by the contention its simulated step would see, and
    that step's timeline: iterated, since the slowing changes which stages overlap."""
    timeline = simulate(schedule, costs=costs)
    if schedule.stages < 2 or all(abs(f - 1.0) <= NOTICEABLE for f in factors):
        return costs, timeline
    slowed_costs = costs
    for _ in range(ROUNDS):
        others = others_computing(timeline)
        scale = [1.0 + max(f - 1.0, 0.0) * o / (schedule.stages - 1)
                 for f, o in zip(factors, others)]
        slowed_costs = slowed(costs, schedule, scale)
        timeline = simulate(schedule, costs=slowed_costs)
    return slowed_costs, timeline


def slowed(costs: Costs, schedule: Schedule, factors: list[float]) -> Costs:
    """``costs`` with each chunk's compute times multiplied by its stage's factor."""
    factor = [factors[schedule.placement[c]] for c in range(schedule.chunks)]

    def scale(values: Any) -> Any:
        return None if values is None else [v * f for v, f in zip(values, factor)]

    return replace(costs, forward=scale(costs.forward), backward=scale(costs.backward),
                   input_grad=scale(costs.input_grad), weight_grad=scale(costs.weight_grad))
