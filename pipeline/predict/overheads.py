"""What the runtime adds to a step beside compute and hops: the executor's cost per action, and
hops refined from the delays a measured step shows. ``Pipe.predict`` reads both.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from schedules import Link, Schedule

from pipeline.group.hops import HopModel


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


def measured_hop_delay(schedule: Schedule, *timelines: Any) -> float | None:
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
