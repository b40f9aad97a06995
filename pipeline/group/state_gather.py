"""A state dict gathered on one rank: each rank's tensors as raw bytes beside a JSON list of
names, dtypes and shapes (nothing a peer sends is unpickled), every collective bounded."""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.distributed as dist

from pipeline.group.collectives import all_gather, wait
from pipeline.group.process_groups import rank_device


def gather_state(local: dict[str, torch.Tensor], group: dist.ProcessGroup, dst: int,
                 timeout: float) -> dict[str, torch.Tensor] | None:
    """Every rank's ``local`` state merged on group rank ``dst`` (in layer order), None elsewhere.

    Raises:
        TypeError: a state entry that is not a tensor (a module's extra state).
        PeerError: a rank did not take part within the timeout.
        ValueError: a peer's description does not match its bytes.
    """
    what = "gathering the state dict"
    device = rank_device(group)  # NCCL carries no CPU tensor: the bytes travel on the GPU
    entries, payload = _encode(local)
    sizes = all_gather(torch.tensor([entries.numel(), payload.numel()], device=device), group,
                       timeout, what)
    described = _gather_bytes(entries, [int(size[0]) for size in sizes], group, dst, timeout,
                              device)
    data = _gather_bytes(payload, [int(size[1]) for size in sizes], group, dst, timeout, device)
    if described is None or data is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for rank_entries, rank_data in zip(described, data):
        merged.update(_decode(rank_entries, rank_data))
    return dict(sorted(merged.items(), key=lambda item: _layer_order(item[0])))


def _gather_bytes(part: torch.Tensor, lengths: list[int], group: dist.ProcessGroup, dst: int,
                  timeout: float, device: torch.device) -> list[torch.Tensor] | None:
    """Every rank's bytes ``part`` (of the given lengths) on group rank ``dst`` (on the CPU);
    None elsewhere."""
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: part.numel()] = part.to(device)
    rows = [torch.empty_like(padded) for _ in lengths] if dist.get_rank(group) == dst else None
    wait(dist.gather(padded, rows, dst=dist.get_global_rank(group, dst), group=group,
                     async_op=True), "gathering the state dict", group, timeout)
    return None if rows is None else [row[:length].cpu() for row, length in zip(rows, lengths)]


def _encode(state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(JSON of [name, dtype, shape] per tensor, as bytes; the tensors' bytes, concatenated)."""
    described, chunks = [], []
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"gather_state_dict: expected tensors in the state dict, got "
                            f"{type(tensor).__name__} under {name!r}")
        described.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)])
        chunks.append(tensor.contiguous().reshape(-1).view(torch.uint8))
    text = json.dumps(described).encode()
    payload = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8), payload


def _decode(entries: torch.Tensor, payload: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inverse of ``_encode``, checking what a peer sent against what it can be."""
    described = json.loads(entries.numpy().tobytes())
    found, offset = {}, 0
    for name, dtype_name, shape in described:
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(name, str) or not isinstance(dtype, torch.dtype) or not all(
                isinstance(size, int) and size >= 0 for size in shape):
            raise ValueError(f"gather_state_dict: a peer described a tensor as {name!r}, "
                             f"{dtype_name!r}, {shape!r}: expected a name, a dtype, a shape")
        count = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offset + count > payload.numel():
            raise ValueError(f"gather_state_dict: a peer sent {payload.numel()} bytes, fewer "
                             f"than its tensors need ({name!r} ends at {offset + count})")
        found[name] = payload[offset: offset + count].clone().view(dtype).reshape(shape)
        offset += count
    return found


def _layer_order(key: str) -> tuple[int, str]:
    head, _, rest = key.partition(".")
    return (int(head), rest) if head.isdigit() else (-1, key)
