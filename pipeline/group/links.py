"""Calibrate, once at build, what a hop between stages costs: ``latency + bytes / bandwidth`` per pair of stages.

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
from schedules.dependencies import crossings

from pipeline.errors import PeerError
from pipeline.group.hops import HopModel

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

SMALL_BYTES = 64
LARGE_BYTES = 1 << 20
ROUNDS = 15  # timed ping-pongs per size (the median is kept)
UNTIMED = 5  # ping-pongs first: the first ones after idle time read up to 10x slower


def hop_pairs(schedule: Schedule) -> list[tuple[int, int]]:
    """The unordered stage pairs ``(low, high)`` between which results cross, sorted."""
    pairs = {(min(source, destination), max(source, destination))
             for _, source, destination in crossings(schedule.placement)}
    return sorted(pairs)


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

    from pipeline.group.collectives import gather_objects

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
    from pipeline.transports.threads import LocalTransport

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


def slowest_link(group: ProcessGroup, device: torch.device, timeout: float) -> Link:
    """The slowest hop between neighbouring ranks of ``group`` (data-parallel replicas: a
    ring's step waits for its slowest hop), by ``calibrate_group`` over a chain of them.
    Every rank of ``group`` calls it."""
    import torch.distributed as dist

    from schedules import get_schedule

    size = dist.get_world_size(group)
    chain = get_schedule("1f1b", stages=size, microbatches=size)
    links = [link for _, _, link in calibrate_group(group, chain, device, timeout).links]
    return Link(max(link.latency for link in links), min(link.bandwidth for link in links))
