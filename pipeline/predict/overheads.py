"""What the runtime adds to a step beside compute and hops: the executor's cost per action,
hops refined from the delays a measured step shows, and the data-parallel replicas'
collectives. ``Pipe.predict`` reads all three.

The replicas' collectives are priced as rings (``partitioners.plan.replicas.ring_seconds``:
``(replicas - 1) x (latency + bytes / replicas / bandwidth)`` per all-gather or
reduce-scatter, twice that per all-reduce) over a ``Link`` between replicas. That link
is measured here, not taken from ``Ranks.hops``: those links join neighbouring
*stages* (ranks of the pipeline's group), none of which is a replica of this one; in a
3D layout the two kinds of pair often sit on different fabrics (replicas inside a node
and stages across, or the reverse), and with one stage there is no hop at all. So
``replicas_link`` runs the very ping-pong that calibrates ``Ranks.hops``
(``pipeline.group.links.calibrate_group``, same sizes and rounds) between neighbouring
replicas of the stage, over its data-parallel group, and keeps the slowest pair: a
ring moves at its slowest hop.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
import torch

from partitioners.plan.replicas import StepCollectives, gathers_per_action, ring_seconds, with_gathers
from schedules import Costs, Link, Op, Schedule, Timeline

from pipeline.group.hops import HopModel
from pipeline.runtime.runner import Runner


# -- the executor's own cost per action ------------------------------------------------------


def action_overhead(device: torch.device, microbatches: int = 16, rounds: int = 3) -> float:
    """Seconds the executor spends per action outside the action's event: its per-action cost.

    Runs ``run_stage`` on a one-stage 1F1B plan whose single chunk is a 1x1 ``Linear``
    on a 1x1 input (an almost empty action), through a ``LocalTransport`` endpoint,
    and takes the wall time of the stage less the time inside its events, per action:
    the clock reads, the event, the plan walk and the hand-over of results. The
    global RNG state is left as it was (a step draws its seed from it).

    Args:
        device: where the chunk runs.
        microbatches: micro-batches per timed run (two actions each).
        rounds: timed runs after one untimed; the median is kept.

    Returns:
        Seconds per action, >= 0.
    """
    from torch import nn

    from schedules import get_schedule

    from pipeline.runtime.executor import StepInputs, run_stage
    from pipeline.runtime.runner import Plans, step_of
    from pipeline.compute.chunk import ChunkOptions, ChunkRunner, ChunkSpec
    from pipeline.transports.threads import LocalTransport

    schedule = get_schedule("1f1b", 1, microbatches)
    plans = Plans(schedule)
    plan = plans.stage(0, infer=False)
    inputs = [torch.ones(1, 1, device=device) for _ in range(microbatches)]
    step_inputs = StepInputs(inputs, [None] * microbatches, [1.0] * microbatches)
    per_action = []
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        layers = nn.Sequential(nn.Linear(1, 1)).to(device)  # its initialisation draws
        chunk = ChunkRunner(ChunkSpec(0, 0, 0, True, True), layers, device,
                            ChunkOptions("never", lambda output, target: output.sum()), None, None)
        for index in range(rounds + 1):
            endpoint = LocalTransport([device]).endpoint(0)
            endpoint.begin_step(plans.training, 0)
            with step_of([chunk], schedule):
                start = time.perf_counter()
                result = run_stage(plan, {0: chunk}, endpoint, step_inputs)
                wall = time.perf_counter() - start
            inside = sum(event.duration for event in result.events)
            if index:
                per_action.append(max(0.0, (wall - inside) / len(result.events)))
    return statistics.median(per_action)


# -- refined from a measured step ------------------------------------------------------------


def measured_hop_delay(schedule: Schedule, *timelines: Timeline) -> float | None:
    """Mean seconds from a result's producer ending to its waiting consumer starting.

    Only transfers the consumer waited for count (its previous action had ended
    before the producer did), so the figure is what a hop adds to the critical path
    in a real step: the transport's latency, its copies, and the moments the
    receiving rank's gloo thread waits for a core. The mean, not the median: the rare
    long hops are paid too.

    Args:
        schedule: the schedule the timeline ran.
        timelines: measured Timelines of it (``Pipe.timeline`` of some steps), pooled.

    Returns:
        The mean delay, or None when no consumer waited on another stage.
    """
    from schedules import dependencies

    delays = []
    for timeline in timelines:
        by_key = {(e.action.op, e.action.microbatch, e.action.chunk): e for e in timeline.events}
        for stage in range(timeline.stages):
            events = timeline.stage_events(stage)
            for previous, event in zip(events, events[1:]):
                for needed in dependencies(schedule, event.action):
                    producer = by_key.get((needed.op, needed.microbatch, needed.chunk))
                    if producer is not None and producer.stage != stage \
                            and producer.end > previous.end:
                        delays.append(event.start - producer.end)
    return statistics.fmean(delays) if delays else None


def refined(hops: HopModel, delay: float, payload: float) -> HopModel:
    """``hops`` with every link's latency set so that a hop of ``payload`` bytes takes ``delay``
    after its producer's event ended, the sender's own cost of the send included (it is
    charged to the producer's action, so it comes off the latency).

    Bandwidths and send costs stay as calibrated; a latency is at least 1 ns.
    """
    links = tuple((s, d, Link(max(delay - payload / link.bandwidth
                                  - hops.send_seconds(s, d, payload), 1e-9), link.bandwidth))
                  for s, d, link in hops.links)
    return HopModel(links, f"{hops.method}, refined from a measured step", hops.senders)


# -- the data-parallel replicas' collectives -------------------------------------------------


@dataclass(frozen=True)
class Collectives:
    """One stage's data-parallel collectives in a step, in seconds (all 0 without replicas).

    Attributes:
        gathers: ``(chunk, seconds)``: all-gathering every FSDP shard group of the chunk once
            (a stage's shard groups shared among its chunks by parameter count).
        reduce: after the stage's last backward, reducing its gradients: one
            reduce-scatter per shard group (FSDP), or one all-reduce per parameter (whole copies).
        per_action: shard groups are gathered again for every forward and backward that finds
            them freed (``reshard_after_forward``), not once per step.

    Plain data across ranks: ``Collectives(*fields)`` rebuilds one from ``fields``.
    """

    gathers: tuple[tuple[int, float], ...] = ()
    reduce: float = 0.0
    per_action: bool = False

    @property
    def fields(self) -> tuple[tuple[tuple[int, float], ...], float, bool]:
        """``(gathers, reduce, per_action)``, as they cross ranks."""
        return self.gathers, self.reduce, self.per_action


def replicas_link(runner: Runner) -> Link | None:
    """The slowest hop between neighbouring replicas of this rank's stage (see the module
    docstring), or None without replicas. Every replica must call it at the same point."""
    return runner.data_parallel.link(runner.chunks[next(iter(runner.chunks))].device)


def stage_collectives(runner: Runner, link: Link | None) -> dict[int, Collectives]:
    """Per local stage, its ``Collectives`` over ``link`` (zero without one). Read between
    steps, the parameters sharded (a DTensor's ``numel`` is its whole size)."""
    schedule = runner.schedule
    sharding = runner.sharding
    found: dict[int, Collectives] = {}
    for stage in {schedule.placement[c] for c in runner.chunks}:
        owned = [c for c in schedule.chunks_of_stage[stage] if c in runner.chunks]
        if link is None or sharding.replicas < 2:
            found[stage] = Collectives()
            continue
        params = {c: list(runner.chunks[c].layers.parameters()) for c in owned}
        if not sharding.sharded:  # whole copies: an all-reduce per parameter gradient
            tensors = {id(p): p for c in owned for p in params[c] if p.requires_grad}
            reduce = sum(2 * ring_seconds(p.numel() * p.element_size(), sharding.replicas, link)
                         for p in tensors.values())
            found[stage] = Collectives((), reduce)
            continue
        per_element = _bytes_per_element([p for c in owned for p in params[c]])
        gathering = sum(ring_seconds(n * per_element, sharding.replicas, link)
                        for n in sharding.shard_groups)
        counts = {c: sum(p.numel() for p in params[c]) for c in owned}
        total = sum(counts.values()) or 1
        found[stage] = Collectives(tuple((c, gathering * counts[c] / total) for c in owned),
                                   gathering,
                                   sharding.reshard_after_forward)
    return found


def _bytes_per_element(parameters: Sequence[torch.Tensor]) -> float:
    elements = sum(p.numel() for p in parameters)
    return sum(p.numel() * p.element_size() for p in parameters) / elements if elements else 0.0


def in_actions(schedule: Schedule, found: dict[int, Collectives]) -> tuple[float, ...]:
    """Per stage, seconds of collectives inside its actions in a step (what a measured busy
    time holds beside compute): the gathers, once each or as often as the schedule frees
    the shard groups (recomputed forwards' gathers left out)."""
    shares = gathers_per_action(schedule)
    seconds = [0.0] * schedule.stages
    for stage, collectives in found.items():
        for chunk, gather in collectives.gathers:
            if not collectives.per_action:
                seconds[stage] += gather
                continue
            ops = [a.op for a in schedule.order[stage] if a.chunk == chunk and a.op is not Op.W]
            seconds[stage] += gather * sum(shares[chunk][op] for op in ops)
    return tuple(seconds)


def replicas_step(costs: Costs, schedule: Schedule, found: dict[int, Collectives]
                  ) -> tuple[Costs, StepCollectives]:
    """``costs`` with the gathers that happen inside actions (``reshard_after_forward``),
    and the collectives outside them: the gathers once per step before, each stage's
    reduction after (``partitioners.plan.replicas.with_step_collectives`` places them)."""
    gather = [0.0] * schedule.chunks
    for collectives in found.values():
        for chunk, seconds in collectives.gathers:
            gather[chunk] = seconds
    last = tuple(found[stage].reduce if stage in found else 0.0
                 for stage in range(schedule.stages))
    per_action = any(collectives.per_action for collectives in found.values())
    if per_action:
        return with_gathers(costs, gather, gathers_per_action(schedule)), StepCollectives(0.0, last)
    return costs, StepCollectives(sum(gather), last)
