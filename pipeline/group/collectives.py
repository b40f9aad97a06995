"""Collectives that honour a Pipe's timeout: a silent peer is a PeerError, not a 30-minute hang.

torch.distributed's collectives wait for the process group's own timeout (30
minutes by default) unless asked otherwise. Each helper here posts the
collective asynchronously and waits at most ``timeout`` seconds, then names the
collective and the group's size in the error.

The values ranks share (settings, a plan, measured costs) cross as
``pipeline.payloads.values`` encodes them, never pickled: a value that may not cross is
refused at its sender, and every rank raises.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipeline.errors import PeerError
from pipeline.payloads.checked_json import StructureError, short
from pipeline.payloads.values import MAX_MESSAGE_BYTES, decode, encode
_REFUSALS = {1: TypeError, 2: ValueError}  # a rank's status in the size gather, when not 0


def wait(work: Any, what: str, group: dist.ProcessGroup, timeout: float) -> None:
    """Wait for a collective posted asynchronously; a PeerError naming ``what`` on timeout."""
    try:
        work.wait(timedelta(seconds=timeout))
    except RuntimeError as error:
        size = dist.get_world_size(group)
        raise PeerError(
            f"rank {dist.get_rank()}: {what} across the {size} ranks of the pipeline did not "
            f"complete within {timeout:g}s (a rank died, hung or is too slow: raise "
            f"Pipe(timeout=...)): {error}"
        ) from error


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, timeout: float, what: str,
               op: Any = dist.ReduceOp.SUM) -> None:
    wait(dist.all_reduce(tensor, op=op, group=group, async_op=True), what, group, timeout)


def union_total(total: float, group: dist.ProcessGroup, timeout: float, device: torch.device
                ) -> tuple[int, float]:
    """The ranks of ``group`` and the sum of their ``total`` (a loss's denominator)."""
    summed = torch.tensor([total], dtype=torch.float64, device=device)
    all_reduce(summed, group, timeout, "adding up the replicas' loss counts")
    return dist.get_world_size(group), float(summed[0])


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup, timeout: float, what: str
               ) -> list[torch.Tensor]:
    rows = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    wait(dist.all_gather(rows, tensor, group=group, async_op=True), what, group, timeout)
    return rows


def all_gather_async(tensor: torch.Tensor, group: dist.ProcessGroup
                     ) -> tuple[Any, list[torch.Tensor]]:
    """Post an all-gather of ``tensor``; ``wait`` for the work before reading the rows."""
    rows = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    return dist.all_gather(rows, tensor, group=group, async_op=True), rows


def barrier(group: dist.ProcessGroup, timeout: float, what: str) -> None:
    wait(dist.barrier(group=group, async_op=True), what, group, timeout)


def gather_objects(value: Any, group: dist.ProcessGroup, timeout: float, what: str,
                   device: torch.device | None = None) -> list[Any]:
    """Every rank's ``value``, on every rank, in group-rank order (two all-gathers: the sizes,
    then the messages). ``value`` may hold what ``encode`` takes: plain data, tensors (they
    arrive on the CPU) and the classes of ``crosses()``.

    Raises:
        TypeError, ValueError: on every rank, when a rank's value may not cross (``encode``);
            the message names that rank and where the value went wrong.
        StructureError: a rank sent bytes that ``encode`` never writes (a ``ValueError``).
        PeerError: a rank did not take part within ``timeout``.
    """
    device = device or torch.device("cpu")
    status, refusal = 0, None
    try:
        data = encode(value)
    except (TypeError, ValueError) as error:  # sent in place of the value: every rank raises
        status, refusal = (1 if isinstance(error, TypeError) else 2), error
        data = str(error).encode()[: 1 << 16]
    header = torch.tensor([len(data), status], dtype=torch.int64, device=device)
    headers = [row.tolist() for row in all_gather(header, group, timeout, what)]
    if any(not 0 <= size <= MAX_MESSAGE_BYTES or flag not in (0, *_REFUSALS)
           for size, flag in headers):
        raise StructureError(f"expected sizes of at most {MAX_MESSAGE_BYTES} bytes and a status "
                             f"among 0, 1, 2 from every rank for {what}, got {short(headers)}")
    padded = torch.zeros(max(size for size, _ in headers), dtype=torch.uint8, device=device)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = all_gather(padded, group, timeout, what)
    blobs = [row[:size].cpu().numpy().tobytes() for row, (size, _) in zip(rows, headers)]
    for rank, (_, flag) in enumerate(headers):
        if flag:
            raise _REFUSALS[flag](f"rank {rank} could not send its part of {what}: "
                                  f"{blobs[rank].decode('utf-8', 'replace')}") from refusal
    return [decode(blob) for blob in blobs]


def broadcast_object(value: Any, source: int, group: dist.ProcessGroup, timeout: float,
                     what: str, device: torch.device | None = None) -> Any:
    """``value`` of group rank ``source``, on every rank (one gather: small objects only)."""
    return gather_objects(value if dist.get_rank(group) == source else None, group, timeout,
                          what, device)[source]
