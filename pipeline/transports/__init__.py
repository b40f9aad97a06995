"""Transports: threads in one process (local), gloo, and NCCL's rules (ordered); the factory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist

from pipeline.transports.base import Transport

from pipeline.errors import PeerError, PipelineAborted

TransportName = Literal["auto", "gloo", "ordered"]
TRANSPORTS: tuple[str, ...] = ("auto", "gloo", "ordered")


def make_transport(
    name: TransportName,
    group: dist.ProcessGroup,
    stage_ranks: Sequence[int],
    stage: int,
    device: torch.device,
    chunks: int,
    channels: Sequence[int],
    timeout: float,
) -> Transport:
    """The transport for one stage of a pipeline process group.

    ``"auto"`` takes ``"ordered"`` under NCCL and ``"gloo"`` otherwise. ``"ordered"``
    follows NCCL's rules on any backend; on gloo it also waits on every send, so a
    CPU run meets the worst case a GPU cluster could (see ``transports.ordered``).

    Raises:
        ValueError: an unknown name.
    """
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; expected one of: {', '.join(TRANSPORTS)}")
    backend = dist.get_backend(group)
    if name == "auto":
        name = "ordered" if backend == "nccl" else "gloo"
    if name == "ordered":
        from pipeline.transports.ordered import OrderedTransport

        return OrderedTransport(group, stage_ranks, stage, device, channels, timeout,
                                rendezvous=backend != "nccl")
    from pipeline.transports.gloo import GlooTransport

    return GlooTransport(group, stage_ranks, stage, device, chunks, timeout)


__all__ = ["PeerError", "PipelineAborted", "Transport", "TRANSPORTS", "make_transport"]
