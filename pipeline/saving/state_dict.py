"""Gather a pipelined model's state on one rank, and save checkpoints atomically."""

from __future__ import annotations

import glob
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pipeline.pipe import Pipe


def gather_state_dict(pipe: Pipe, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The full model's state dict on group rank ``dst`` (CPU tensors), None elsewhere.

    Every rank of the pipe's group must call it; in a mesh with sharded or tensor-
    parallel layers, every rank of the mesh (a shard is gathered whole first), and each
    pipeline of the mesh gathers onto its own rank ``dst``. In one process it is simply
    the model's state dict. For large models prefer ``save_checkpoint``, which never
    gathers. The keys are the original model's (``"4.weight"``), so the
    result loads into the unpipelined model. Each rank's tensors travel as raw bytes
    beside a JSON list of names, dtypes and shapes (nothing a peer sends is
    unpickled), and every collective waits at most the Pipe's ``timeout``.

    Raises:
        TypeError: a state entry that is not a tensor (a module's extra state).
        PeerError: a rank did not take part within the timeout.
    """
    local = {name: tensor.detach().cpu() for name, tensor in pipe.state_dict().items()}
    gathered: dict[str, torch.Tensor] | None = pipe.ranks.gather_state(local, dst)
    return gathered


def save_state_dict(state: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to a temporary file beside ``path``, then rename it into place.

    A crash mid-write leaves the previous checkpoint (or nothing), never half a file.
    A process killed mid-write cannot remove its temporary file, so each save first
    removes the ones that writers no longer alive left beside ``path``.

    Raises:
        CheckpointError: ``path`` names a directory (``"."`` included) or a place that
            cannot be written (the system's reason); nothing is left behind.
    """
    from pipeline.saving.format import CheckpointError

    target = Path(path)
    if target.name in ("", ".", "..") or target.is_dir():
        raise CheckpointError(
            f"save_state_dict writes one file; {str(path)!r} is a directory: name a file in "
            f"it, e.g. {str(Path(path) / 'model.pt')!r}"
        )
    temporary = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(target)
        handle, temporary = tempfile.mkstemp(
            dir=target.parent, prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp"
        )
        with os.fdopen(handle, "wb") as stream:
            torch.save(state, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except OSError as error:
        raise CheckpointError(f"cannot write {str(path)!r}: {error.strerror or error}") from error
    finally:
        if temporary is not None and Path(temporary).exists():
            Path(temporary).unlink(missing_ok=True)
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
