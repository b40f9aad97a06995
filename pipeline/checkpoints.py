"""Distributed checkpoints that reshard: each rank writes its own layers and optimizer state.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory keyed by the model's
own names, so that it loads into any cut of the same model: written by 2 ranks, read by
4 ranks, by one process running 3 stages as threads, or by the unpipelined
``nn.Sequential`` with a plain optimizer. What it holds:

- ``model.<name>``: every parameter and buffer under the ``nn.Sequential``'s names
  (``"model.4.weight"``), written by the rank that runs the layer; no rank gathers the model.
- ``optim.state.<name>.<key>`` and ``optim.param_groups.<name>.<key>``: the optimizer's
  state and hyperparameters per parameter name (DCP's flattened optimizer state dict,
  ``StateDictOptions(flatten_optimizer_state_dict=True)``), never by the local
  parameter order that ``optimizer.state_dict()`` uses.
- ``step``: the training step given to ``save_checkpoint``.
- ``rng.cpu.rank<r>``: torch's default CPU generator state of rank r (0 in one process),
  as a uint8 tensor. On loading, rank r takes rank r's state when the checkpoint has
  one, else rank 0's (ranks draw one step seed per step, so ranks seeded alike stay alike).

Writes are atomic at the directory level: every rank writes into ``.<name>.partial``
beside ``path`` (marked by an ``.incomplete`` file), and after a barrier the first rank
removes the mark and renames the directory into place. A run killed during the save
leaves the previous checkpoint (or none) at ``path``; the leftover is removed by the
next save. A directory without DCP's ``.metadata`` file, or with the mark, is refused.
Every rank must see the same file system.

Not saved: learning-rate schedulers, gradient scalers, CUDA generators and data-loader
positions (save them beside the checkpoint if needed). The optimizer's hyperparameters
(``lr``, ``betas``...) are saved and restored with its state.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from pipeline.group.ranks import OneProcess, RankGroup, Ranks

if TYPE_CHECKING:
    from pipeline.pipe import Pipe

METADATA_FILE = ".metadata"  # what DCP's coordinator writes last, once every rank wrote
INCOMPLETE_MARK = ".incomplete"  # inside a directory still being written
STEP_KEY = "step"
RNG_PREFIX = "rng.cpu.rank"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(frozen=True)
class _Scope:
    """What one process writes or reads: its layers under their model names, and its peers."""

    module: nn.Module  # this rank's layers, named as in the nn.Sequential
    ranks: Ranks  # every process that writes or reads the checkpoint
    device: torch.device  # where this process's collectives run

    @property
    def coordinator(self) -> bool:
        return self.ranks.rank == 0


def save_checkpoint(pipe: Pipe, optimizer: torch.optim.Optimizer | None,
                    path: str | os.PathLike[str], step: int) -> None:
    """Write ``pipe``'s model, ``optimizer``'s state, ``step`` and the RNG state to ``path``.

    Every rank of the pipe's group calls it (with a data-parallel group: every rank of
    the default group) with the same ``path`` and ``step``; each writes only the layers
    it runs and their optimizer state. ``path`` is a directory; one already there is
    replaced only once the new checkpoint is complete.

    Args:
        pipe: a Pipe, in one process or with a group (its runner built: after the first
            step when ``balance="time"`` waited for a batch).
        optimizer: an optimizer over ``pipe.parameters()``, or None for the model alone.
        path: the checkpoint directory.
        step: the training step, returned by ``load_checkpoint``.

    Raises:
        ValueError: the optimizer holds a parameter this rank's layers do not.
        PeerError: a rank did not reach a barrier within the Pipe's timeout.
        torch.distributed.checkpoint.api.CheckpointException: a rank failed to write.
    """
    _save(_scope_of_pipe(pipe), optimizer, Path(path), step)


def load_checkpoint(pipe: Pipe, optimizer: torch.optim.Optimizer | None,
                    path: str | os.PathLike[str]) -> int:
    """Load a checkpoint of ``save_checkpoint`` into ``pipe`` and ``optimizer``; the step.

    Any cut of the same model loads it: each rank reads the entries of the layers it
    runs, and the optimizer state of their parameters, by name. Every rank of the pipe's
    group calls it. The optimizer must be of the kind that saved (its state keys are
    required); its hyperparameters are the checkpoint's afterwards. Gradients are kept.

    Raises:
        FileNotFoundError: no directory at ``path``.
        ValueError: ``path`` is not a complete checkpoint (no ``.metadata``, or a save
            that was interrupted), or it lacks an entry this rank needs (another model,
            or another kind of optimizer); with a group, the other ranks raise
            RuntimeError naming the check that failed.
        torch.distributed.checkpoint.api.CheckpointException: a rank failed to read, or
            a saved tensor's shape differs from the model's.
    """
    return _load(_scope_of_pipe(pipe), optimizer, Path(path))


def load_into_model(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    path: str | os.PathLike[str]) -> int:
    """Load a checkpoint into the unpipelined model (``nn.Sequential``) and a plain optimizer.

    Runs in one process, without collectives (even where a process group exists); the
    RNG state restored is rank 0's. Returns the saved step. Raises as ``load_checkpoint``.
    """
    return _load(_Scope(model, OneProcess(0.0), torch.device("cpu")), optimizer, Path(path))


def save_model_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                          path: str | os.PathLike[str], step: int) -> None:
    """Write the unpipelined model's checkpoint (one process), loadable by any Pipe cut."""
    _save(_Scope(model, OneProcess(0.0), torch.device("cpu")), optimizer, Path(path), step)


def check_complete(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path when it holds a complete checkpoint.

    Raises:
        FileNotFoundError: nothing at ``path`` (naming the previous checkpoint a save
            interrupted while replacing it left beside it, if any).
        ValueError: ``path`` is not a directory, has no ``.metadata`` or is still marked
            incomplete.
    """
    directory = Path(path)
    if not directory.exists():
        previous = _previous_of(directory)
        hint = (f"; a save interrupted while replacing it left the previous checkpoint at "
                f"{previous}" if previous.is_dir() else "")
        raise FileNotFoundError(f"no checkpoint at {directory}{hint}")
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a checkpoint directory (save_checkpoint writes "
                         f"a directory; a single-file state dict loads with torch.load)")
    if (directory / INCOMPLETE_MARK).exists() or not (directory / METADATA_FILE).is_file():
        raise ValueError(
            f"{directory} is not a complete checkpoint: "
            + ("it is marked as being written (a save that was interrupted or is still running)"
               if (directory / INCOMPLETE_MARK).exists() else
               f"it has no {METADATA_FILE} file, which a save writes last")
            + "; load the checkpoint it was meant to replace instead"
        )
    return directory


# -- where each rank stands ------------------------------------------------------------------


def _scope_of_pipe(pipe: Pipe) -> _Scope:
    view = nn.Module()  # the local layers under the nn.Sequential's names: "4.weight"
    for index in pipe.local_layers:
        view.add_module(str(index), pipe.model[index])
    ranks, settings = pipe.ranks, pipe.distributed
    if settings is not None:
        # Data-parallel replicas write the same keys (DCP keeps one copy): all take part.
        ranks = RankGroup(settings.holders, pipe.timeout)
    return _Scope(view, ranks, pipe.devices[0])


def _check_optimizer(scope: _Scope, optimizer: torch.optim.Optimizer | None) -> None:
    if optimizer is None:
        return
    held = {id(p) for p in scope.module.parameters()}
    foreign = sum(1 for group in optimizer.param_groups for p in group["params"]
                  if id(p) not in held)
    if foreign:
        raise ValueError(f"the optimizer holds {foreign} parameter(s) that this rank's layers "
                         f"do not: build it over pipe.parameters()")


def _agree(scope: _Scope, failure: BaseException | None, what: str) -> None:
    """A barrier that also tells every rank whether any rank failed before it."""
    failed = scope.ranks.gather(failure is not None, what, scope.device)
    if failure is not None:
        raise failure
    if any(failed):
        raise RuntimeError(f"checkpoint: another rank failed {what}")


# -- what a checkpoint holds -----------------------------------------------------------------


def _state(scope: _Scope, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """This rank's entries, under the checkpoint's keys (the live tensors, not copies)."""
    if optimizer is None:
        return {"model": get_model_state_dict(scope.module, options=_OPTIONS)}
    # DCP creates a fresh optimizer's state by one step of zero gradients, but skips that
    # when a parameter has a gradient: set them aside meanwhile, then give them back.
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    gradients = [p.grad for p in parameters]
    for parameter in parameters:
        parameter.grad = None
    try:
        model_state, optimizer_state = get_state_dict(scope.module, optimizer, options=_OPTIONS)
    finally:
        for parameter, gradient in zip(parameters, gradients):
            parameter.grad = gradient
    return {"model": model_state, "optim": optimizer_state}


def _flat_keys(state: dict[str, Any]) -> list[str]:
    """The keys DCP stores ``state`` under: nested dicts joined with dots."""
    keys: list[str] = []
    for key, value in state.items():
        keys += [f"{key}.{inner}" for inner in _flat_keys(value)] if isinstance(value, dict) \
            else [key]
    return keys


def _rng_key(rank: int) -> str:
    return f"{RNG_PREFIX}{rank}"


# -- saving ----------------------------------------------------------------------------------


def _staging_of(target: Path) -> Path:
    return target.parent / f".{target.name}.partial"


def _previous_of(target: Path) -> Path:
    return target.parent / f".{target.name}.previous"


def _save(scope: _Scope, optimizer: torch.optim.Optimizer | None, target: Path,
          step: int) -> None:
    _check_optimizer(scope, optimizer)
    staging = _staging_of(target)
    failure: BaseException | None = None
    if scope.coordinator:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)  # what an interrupted save left
            staging.mkdir()
            (staging / INCOMPLETE_MARK).write_bytes(b"")
        except OSError as error:
            failure = error
    _agree(scope, failure, "preparing the checkpoint directory")

    state = _state(scope, optimizer)
    state[STEP_KEY] = torch.tensor(int(step), dtype=torch.int64)
    state[_rng_key(scope.ranks.rank)] = torch.get_rng_state()
    scope.ranks.write_checkpoint(state, staging)
    # DCP's coordinator wrote .metadata after every rank's data: the checkpoint is whole.

    failure = None
    if scope.coordinator:
        try:
            _publish(staging, target)
        except OSError as error:
            failure = error
    _agree(scope, failure, "publishing the checkpoint")  # nobody returns before it is in place


def _publish(staging: Path, target: Path) -> None:
    """Move the finished ``staging`` to ``target``; the old ``target`` goes only after."""
    (staging / INCOMPLETE_MARK).unlink()
    _fsync_directory(staging)
    previous = _previous_of(target)
    shutil.rmtree(previous, ignore_errors=True)
    if target.exists():
        os.replace(target, previous)  # a directory cannot replace a non-empty one in one step
    os.replace(staging, target)
    _fsync_directory(target.parent)
    shutil.rmtree(previous, ignore_errors=True)


def _fsync_directory(directory: Path) -> None:
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not every platform opens directories
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


# -- loading ---------------------------------------------------------------------------------


def _load(scope: _Scope, optimizer: torch.optim.Optimizer | None, path: Path) -> int:
    _check_optimizer(scope, optimizer)
    directory = check_complete(path)
    saved = FileSystemReader(directory).read_metadata().state_dict_metadata
    state = _state(scope, optimizer)
    state[STEP_KEY] = torch.zeros((), dtype=torch.int64)
    rng_key = next((key for key in (_rng_key(scope.ranks.rank), _rng_key(0)) if key in saved),
                   None)
    if rng_key is not None:
        state[rng_key] = torch.get_rng_state()  # a placeholder of the right size, filled in
    missing = [key for key in _flat_keys(state) if key not in saved]
    _agree(scope, None if not missing else ValueError(
        f"the checkpoint at {directory} lacks {len(missing)} entries this rank needs (first: "
        f"{', '.join(missing[:3])}): it was saved from another model, or with another kind of "
        f"optimizer (its state keys differ)"), "checking the checkpoint's entries")
    scope.ranks.read_checkpoint(state, directory)
    if optimizer is None:
        set_model_state_dict(scope.module, state["model"], options=_OPTIONS)
    else:
        set_state_dict(scope.module, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=_OPTIONS)
    if rng_key is not None:
        torch.set_rng_state(state[rng_key])
    return int(state[STEP_KEY].item())
