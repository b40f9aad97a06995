"""Gather a pipelined model's state on one rank, and save checkpoints atomically."""

from __future__ import annotations

import glob
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.group.collectives import all_gather, wait


def gather_state_dict(pipe: Any, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The full model's state dict on group rank ``dst`` (CPU tensors), None elsewhere.

    Every rank of the pipe's group must call it. In one process it is simply the
    model's state dict. The keys are the original model's (``"4.weight"``), so the
    result loads into the unpipelined model. Each rank's tensors travel as raw bytes
    beside a JSON list of names, dtypes and shapes (nothing a peer sends is
    unpickled), and every collective waits at most the Pipe's ``timeout``.

    Raises:
        TypeError: a state entry that is not a tensor (a module's extra state).
        PeerError: a rank did not take part within the timeout.
    """
    local = {name: tensor.detach().cpu() for name, tensor in pipe.state_dict().items()}
    group = getattr(pipe, "_group", None)
    if group is None:
        return local
    timeout, what = pipe.timeout, "gathering the state dict"
    entries, payload = _encode(local)
    sizes = all_gather(torch.tensor([entries.numel(), payload.numel()]), group, timeout, what)
    described = _gather_bytes(entries, [int(size[0]) for size in sizes], group, dst, timeout)
    data = _gather_bytes(payload, [int(size[1]) for size in sizes], group, dst, timeout)
    if described is None or data is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for rank_entries, rank_data in zip(described, data):
        merged.update(_decode(rank_entries, rank_data))
    return dict(sorted(merged.items(), key=lambda item: _layer_order(item[0])))


def _gather_bytes(part: torch.Tensor, lengths: list[int], group: dist.ProcessGroup, dst: int,
                  timeout: float) -> list[torch.Tensor] | None:
    """Every rank's bytes ``part`` (of the given lengths) on group rank ``dst``; None elsewhere."""
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: part.numel()] = part
    rows = [torch.empty_like(padded) for _ in lengths] if dist.get_rank(group) == dst else None
    wait(dist.gather(padded, rows, dst=dist.get_global_rank(group, dst), group=group,
                     async_op=True), "gathering the state dict", group, timeout)
    return None if rows is None else [row[:length] for row, length in zip(rows, lengths)]


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


def save_state_dict(state: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to a temporary file beside ``path``, then rename it into place.

    A crash mid-write leaves the previous checkpoint (or nothing), never half a file.
    A process killed mid-write cannot remove its temporary file, so each save first
    removes the ones that writers no longer alive left beside ``path``.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(target)
    handle, temporary = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp"
    )
    try:
        with os.fdopen(handle, "wb") as stream:
            torch.save(state, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target


def _remove_abandoned(target: Path) -> None:
    for leftover in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
        writer = leftover.name[len(target.name) + 2 :].split(".", 1)[0]
        if writer.isdigit() and not _alive(int(writer)):
            leftover.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
