"""The process group around a pipeline: this rank's device, the ranks' agreement on their
arguments, clock alignment, schedule fingerprints, and pipeline x data-parallel groups."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from schedules import Schedule

from units.calls import describe

from pipeline.group.collectives import barrier, gather_objects

_SHOWN = 2000  # characters of a sample's structure, to name it
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def rank_device(group: dist.ProcessGroup) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` under NCCL, the CPU otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def check_agreement(group: dist.ProcessGroup, timeout: float, traced_sample: Any = None,
                    **settings: Any) -> None:
    """Raise ValueError on every rank unless all ranks of ``group`` passed the same settings
    and, for a model traced on every rank, samples of one structure (``units.calls.describe``).

    One small all-gather, the sample in it as a digest of its structure; the message names
    each rank that differs from the majority. Only when the digests differ do the ranks
    send their samples' structures (bounded text, never pickled), to name each rank's.
    """
    mine = {name: repr(value) for name, value in settings.items()}
    described = _ADDRESS.sub("", describe(traced_sample))  # a default repr's address differs
    digest = hashlib.sha256(described.encode()).hexdigest()[:32]
    device = rank_device(group)
    gathered = gather_objects((mine, digest), group, timeout, "checking that the ranks agree",
                              device)
    problems = []
    for name in settings:
        values = [g[0][name] for g in gathered]
        common, _ = Counter(values).most_common(1)[0]
        for rank, value in enumerate(values):
            if value != common:
                problems.append(f"rank {rank} has {name}={value} but the others have {common}")
    if len({g[1] for g in gathered}) > 1:  # every rank sees it: every rank gathers again
        if len(described) > _SHOWN:
            described = described[:_SHOWN] + "..."
        shown = gather_objects(described, group, timeout, "naming the samples the ranks trace",
                               device)
        problems.append(_samples_differ(shown))
    if problems:
        raise ValueError("pipeline ranks disagree: " + "; ".join(problems))


def _samples_differ(shown: list[Any]) -> str:
    """Each structure once, after the ranks that passed it."""
    ranks: dict[str, list[str]] = {}
    for rank, text in enumerate(shown):
        text = text[: _SHOWN + 3] if isinstance(text, str) else "?"
        ranks.setdefault(text, []).append(str(rank))
    seen = ", ".join(f"rank{'s' if len(who) > 1 else ''} {', '.join(who)} {text}"
                     for text, who in ranks.items())
    return (f"the ranks were given different samples to trace: {seen}: pass every rank the "
            f"same sample (its sizes decide the trace)")


def clock_offset(group: dist.ProcessGroup, timeout: float, device: torch.device) -> float:
    """Seconds to subtract from this rank's ``time.perf_counter()`` to read the first rank's.

    Ranks on one host read the same monotonic clock: 0. Across hosts the offset is
    measured once, at the exit of a barrier (good to a fraction of a millisecond), so
    that steps need no barrier of their own.
    """
    barrier(group, timeout, "aligning clocks")
    now = time.perf_counter()
    mine = (socket.gethostname(), now)
    gathered = gather_objects(mine, group, timeout, "aligning clocks", device)
    first_host, first_now = gathered[0]
    return 0.0 if first_host == mine[0] else now - first_now


def schedule_digest(schedule: Schedule) -> str:
    """A short fingerprint of a schedule's full timetable."""
    text = f"{schedule.stages}/{schedule.microbatches}/{schedule.placement}/{schedule}"
    return f"{schedule.name}:{hashlib.sha1(text.encode()).hexdigest()[:12]}"


def make_groups(pipeline_size: int, data_parallel_size: int
                ) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Build this rank's pipeline group and data-parallel group from the world: a thin helper
    over ``init_device_mesh((data_parallel_size, pipeline_size), ("dp", "pp"))``.

    Ranks are laid out ``rank = replica * pipeline_size + stage``: each pipeline
    holds consecutive ranks, and the replicas of one stage form a data-parallel
    group. Every rank must call this (it creates every group, in the same order).
    ``Pipe(..., mesh=...)`` takes such a mesh directly.

    Returns:
        ``(pipeline_group, data_group)`` for the calling rank.

    Raises:
        ValueError: the world size is not ``pipeline_size * data_parallel_size``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if pipeline_size < 1 or data_parallel_size < 1 or pipeline_size * data_parallel_size != world:
        raise ValueError(
            f"pipeline_size x data_parallel_size must equal the world size {world}, got "
            f"{pipeline_size} x {data_parallel_size}"
        )
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (data_parallel_size, pipeline_size),
                            mesh_dim_names=("dp", "pp"))
    return mesh["pp"].get_group(), mesh["dp"].get_group()


def check_ranks_agree(group: dist.ProcessGroup, timeout: float, **arguments: Any) -> None:
    """Raise on every rank unless every rank passed the same ``arguments`` (a Schedule is
    compared by its digest, ``traced_sample`` by its structure's)."""
    schedule = arguments.get("schedule")
    if isinstance(schedule, Schedule):
        arguments["schedule"] = schedule_digest(schedule)
    check_agreement(group, timeout, **arguments)
