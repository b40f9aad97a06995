"""Collectives that honour a Pipe's timeout: a silent peer is a PeerError, not a 30-minute hang.

torch.distributed's collectives wait for the process group's own timeout (30
minutes by default) unless asked otherwise. Each helper here posts the
collective asynchronously and waits at most ``timeout`` seconds, then names the
collective and the group's size in the error.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import types
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipeline.transports.base import PeerError


def wait(work: Any, what: str, group: Any, timeout: float) -> None:
    """Wait for a collective posted asynchronously; a PeerError naming ``what`` on timeout."""
    try:
        work.wait(timedelta(seconds=timeout))
    except RuntimeError as error:
        size = dist.get_world_size(group)
        raise PeerError(
            f"rank {dist.get_rank()}: {what} across the {size} ranks of the pipeline did not "
            f"complete within {timeout:g}s (a rank died, hung or is too slow: raise "
            f"Pipe(timeout=...)): {error}", -1
        ) from error


def all_reduce(tensor: torch.Tensor, group: Any, timeout: float, what: str,
               op: Any = dist.ReduceOp.SUM) -> None:
    wait(dist.all_reduce(tensor, op=op, group=group, async_op=True), what, group, timeout)


def all_gather(tensor: torch.Tensor, group: Any, timeout: float, what: str) -> list[torch.Tensor]:
    rows = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    wait(dist.all_gather(rows, tensor, group=group, async_op=True), what, group, timeout)
    return rows


def all_gather_async(tensor: torch.Tensor, group: Any) -> tuple[Any, list[torch.Tensor]]:
    """Post an all-gather of ``tensor``; ``wait`` for the work before reading the rows."""
    rows = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    return dist.all_gather(rows, tensor, group=group, async_op=True), rows


def barrier(group: Any, timeout: float, what: str) -> None:
    wait(dist.barrier(group=group, async_op=True), what, group, timeout)


def gather_objects(value: Any, group: Any, timeout: float, what: str,
                   device: torch.device | None = None) -> list[Any]:
    """Every rank's ``value`` (picklable), on every rank, in group-rank order."""
    device = device or torch.device("cpu")
    data = torch.frombuffer(bytearray(_dumps(value)), dtype=torch.uint8).to(device)
    sizes = all_gather(torch.tensor([data.numel()], device=device), group, timeout, what)
    longest = int(max(int(size) for size in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    rows = all_gather(padded, group, timeout, what)
    return [pickle.loads(row[: int(size)].cpu().numpy().tobytes()) for row, size in zip(rows, sizes)]


def broadcast_object(value: Any, source: int, group: Any, timeout: float, what: str,
                     device: torch.device | None = None) -> Any:
    """``value`` of group rank ``source``, on every rank (one gather: small objects only)."""
    return gather_objects(value if dist.get_rank(group) == source else None, group, timeout,
                          what, device)[source]


def _dumps(value: Any) -> bytes:
    """``pickle.dumps`` that also takes read-only mappings (frozen dataclasses hold them)."""
    stream = io.BytesIO()
    pickler = pickle.Pickler(stream)
    pickler.dispatch_table = {**copyreg.dispatch_table,
                              types.MappingProxyType: lambda m: (read_only, (dict(m),))}
    pickler.dump(value)
    return stream.getvalue()


def read_only(mapping: dict[Any, Any]) -> types.MappingProxyType[Any, Any]:
    """Rebuilds a read-only mapping on the receiving rank (see ``_dumps``)."""
    return types.MappingProxyType(mapping)
