"""Calibrate what a hop between stages costs: ``latency + bytes / bandwidth`` per pair of stages.

A short ping-pong of two message sizes between the stages that exchange
results (the stage pairs the schedule's placement makes neighbours) fits
``schedules.Link(latency, bandwidth)`` to each pair: the one-way time of the
small message is almost all latency, the difference to the large one is bytes
over bandwidth.

- Across ranks (``calibrate_group``) the messages are plain
  ``torch.distributed`` ``isend``/``irecv`` over the pipeline's process group,
  on the rank's device, each wait bounded by the Pipe's timeout. The pairs run
  one at a time in one global order, so no rank waits for a pair whose other
  end is busy with a later one. Every rank ends with every pair's link.
- In one process (``calibrate_local``) the messages cross between two threads
  through ``LocalTransport``, the runtime's own path: a mailbox hand-off (the
  thread wake-up is the latency) and the copy onto the receiving device (zero
  on one CPU, a device copy between GPUs).

The result, a ``HopModel``, is callable as ``Costs.comm``.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from schedules import Link, Op, Schedule

from pipeline.hops import HopModel as HopModel  # re-exported: its home until pipeline.hops
from pipeline.transports.base import PeerError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

SMALL_BYTES = 64
LARGE_BYTES = 1 << 20
ROUNDS = 15  # timed ping-pongs per size (the median is kept)
UNTIMED = 5  # ping-pongs first: the first ones after idle time read up to 10x slower


def hop_pairs(schedule: Schedule) -> list[tuple[int, int]]:
    """The unordered stage pairs ``(low, high)`` between which results cross, sorted."""
    placement = schedule.placement
    pairs = {tuple(sorted((placement[c], placement[c + 1])))
             for c in range(schedule.chunks - 1) if placement[c] != placement[c + 1]}
    return sorted(pairs)  # type: ignore[arg-type]


def fit_link(small: float, large: float, small_bytes: int = SMALL_BYTES,
             large_bytes: int = LARGE_BYTES) -> Link:
    """The ``Link`` through two one-way times; latency > 0 and bandwidth finite always.

    Args:
        small: seconds for ``small_bytes``.
        large: seconds for ``large_bytes``.

    Returns:
        ``Link(latency, bandwidth)``: bandwidth from the slope (capped at 1e13 B/s
        when the large message was no slower), latency from the small message less
        its bytes' share, at least 1 ns.
    """
    slope = max(large - small, (large_bytes - small_bytes) / 1e13)
    bandwidth = (large_bytes - small_bytes) / slope
    latency = max(small - small_bytes / bandwidth, 1e-9)
    return Link(latency=latency, bandwidth=bandwidth)


# -- across ranks ----------------------------------------------------------------------------


def calibrate_group(group: ProcessGroup, schedule: Schedule, device: torch.device,
                    timeout: float) -> HopModel:
    """Ping-pong between the ranks of each hop pair of ``schedule``; every rank gets all links.

    Plain ``dist.isend``/``dist.irecv`` over ``group`` (group rank = stage), not the
    transport's packed messages: a transport adds a header and a copy, which the
    runtime's per-action overhead covers.

    Args:
        group: the pipeline's process group; every rank calls this.
        schedule: the schedule whose placement says which stages exchange results.
        device: this rank's device (the messages live there).
        timeout: seconds any one wait may take.

    Returns:
        A HopModel with both directions of every pair.

    Raises:
        PeerError: a peer did not answer within ``timeout``.
    """
    import torch.distributed as dist

    from pipeline.collectives import gather_objects

    stage = dist.get_rank(group)
    mine: dict[tuple[int, int], tuple[float, ...]] = {}
    for index, (low, high) in enumerate(hop_pairs(schedule)):
        if stage in (low, high):
            peer = high if stage == low else low
            times = _ping_pong(group, peer, stage == low, device, timeout, index)
            if stage == low:
                mine[(low, high)] = times
    gathered = gather_objects(mine, group, timeout, "sharing the calibrated links", device)
    links, senders = [], []
    for measured in gathered:
        for (low, high), (small, large, send_small, send_large) in measured.items():
            link = fit_link(small, large)
            links += [(low, high, link), (high, low, link)]
            sender = fit_link(send_small, send_large)
            senders += [(low, high, sender), (high, low, sender)]
    return HopModel(tuple(links), "gloo ping-pong" if dist.get_backend(group) == "gloo"
                    else f"{dist.get_backend(group)} ping-pong", tuple(senders))


def _ping_pong(group: ProcessGroup, peer: int, leads: bool, device: torch.device,
               timeout: float, pair: int) -> tuple[float, float, float, float]:
    """One-way seconds (median of half round trips) for the small and the large message,
    then what a send of each cost the leader itself (median), sent as the runtime sends:
    the payload copied into the message, the receive posted before, a yield after."""
    import torch.distributed as dist

    global_peer = dist.get_global_rank(group, peer)
    yields = device.type == "cpu" and hasattr(os, "sched_yield")  # as GlooTransport does
    trips_found, sends_found = [], []
    for size_index, nbytes in enumerate((SMALL_BYTES, LARGE_BYTES)):
        payload = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        message = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        tag = 1_000_000 + pair * 2 + size_index
        trips, sends = [], []
        incoming = dist.irecv(message, global_peer, group=group, tag=tag)
        for round_index in range(UNTIMED + ROUNDS):
            start = time.perf_counter()
            if not leads:
                _wait(incoming, timeout, peer)
            message.copy_(payload)
            sent = time.perf_counter()
            outgoing = dist.isend(message, global_peer, group=group, tag=tag)
            if yields:
                os.sched_yield()
            spent = time.perf_counter() - sent
            if leads:
                _wait(incoming, timeout, peer)
            _wait(outgoing, timeout, peer)
            if round_index + 1 < UNTIMED + ROUNDS:
                incoming = dist.irecv(message, global_peer, group=group, tag=tag)
            if round_index >= UNTIMED:
                trips.append((time.perf_counter() - start) / 2)
                sends.append(spent)
        trips_found.append(statistics.median(trips))
        sends_found.append(statistics.median(sends))
    return trips_found[0], trips_found[1], sends_found[0], sends_found[1]


def _wait(work: Any, timeout: float, peer: int) -> None:
    try:
        work.wait(timedelta(seconds=timeout))
    except RuntimeError as error:
        raise PeerError(f"calibrating the hop to stage {peer}: no answer within {timeout:g}s "
                        f"(raise Pipe(timeout=...) if that stage is slow): {error}", peer) from error


# -- one process -----------------------------------------------------------------------------


def calibrate_local(devices: Sequence[torch.device], schedule: Schedule,
                    timeout: float) -> HopModel:
    """Ping-pong between two threads through ``LocalTransport`` for each hop pair.

    Args:
        devices: one device per stage.
        schedule: the schedule whose placement says which stages exchange results.
        timeout: seconds a thread may wait for the other.

    Returns:
        A HopModel with both directions of every pair.
    """
    links = []
    for low, high in hop_pairs(schedule):
        small, large = _thread_ping_pong(devices[low], devices[high], timeout)
        link = fit_link(small, large)
        links += [(low, high, link), (high, low, link)]
    return HopModel(tuple(links), "thread hand-off through LocalTransport")


def _thread_ping_pong(first: torch.device, second: torch.device,
                      timeout: float) -> tuple[float, float]:
    from pipeline.transports.local import LocalTransport

    transport = LocalTransport([first, second], timeout)
    ends = [transport.endpoint(0), transport.endpoint(1)]
    found = []
    for nbytes in (SMALL_BYTES, LARGE_BYTES):
        payload = torch.zeros(nbytes, dtype=torch.uint8, device=first)
        errors: list[BaseException] = []

        def echo(rounds: int = UNTIMED + ROUNDS) -> None:
            try:
                for index in range(rounds):
                    received = _synced(ends[1].receive((Op.F, index, 0), 0), second)
                    ends[1].send((Op.B, index, 0), 0, received)
            except BaseException as error:  # reported by the caller
                errors.append(error)

        helper = threading.Thread(target=echo, name="pipesched-calibration", daemon=True)
        helper.start()
        trips = []
        for index in range(UNTIMED + ROUNDS):
            start = time.perf_counter()
            ends[0].send((Op.F, index, 0), 1, payload)
            payload = _synced(ends[0].receive((Op.B, index, 0), 1), first)
            if index >= UNTIMED:
                trips.append((time.perf_counter() - start) / 2)
        helper.join(timeout)
        if errors:
            raise errors[0]
        found.append(statistics.median(trips))
    return found[0], found[1]


def _synced(payload: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return payload


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

    from pipeline.executor import StepInputs, run_stage
    from pipeline.runner import Plans, step_of
    from pipeline.stage import ChunkOptions, ChunkRunner, ChunkSpec
    from pipeline.transports.local import LocalTransport

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
