"""Distributed checkpoints that reshard: each rank writes its own layers and optimizer state.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory keyed by the model's
own names, so that it loads into any cut of the same model: written by 2 ranks, read by
4 ranks, by one process running 3 stages as threads, or by the unpipelined
``nn.Sequential`` with a plain optimizer. What it holds:

- ``model.<name>``: every parameter and buffer under the ``nn.Sequential``'s names
  (``"model.4.weight"``), written by the rank that runs the layer; no rank gathers the model.
- ``optim.state.<name>.<key>`` and ``optim.param_groups.<name>.<key>``: the optimizer's
  state and hyperparameters under each of the parameter's names, never by the local
  parameter order that ``optimizer.state_dict()`` uses. A parameter without state (a fresh
  optimizer) has none saved, and loads without state.
- ``step``: the training step given to ``save_checkpoint``.
- ``rng.cpu.rank<r>``: torch's default CPU generator state of rank r (0 in one process),
  as a uint8 tensor. On loading, rank r takes rank r's state when the checkpoint has
  one, else rank 0's (ranks draw one step seed per step, so ranks seeded alike stay alike).
- ``.checkpoint.json``: the index (DCP's metadata as checked JSON) and the size and
  SHA-256 of every file written, ``.metadata`` included (``pipeline.saving.manifest``).

The trust model. Saving only reads (no optimizer step, gradients untouched:
``pipeline.saving.state``). Loading is strict and checks before it reads: the
manifest's own digest, then ``.metadata``'s and each data file's that this rank reads;
missing or unexpected keys, shapes, the optimizer's kind, and the values of tied keys
are errors naming them, on every rank. No byte of a checkpoint or of a peer is unpickled:
``.metadata`` (DCP's pickle, kept for DCP's own tools) is never read back, bytes entries
are read with ``torch.load(weights_only=True)``, and DCP runs rank by rank with its plans
and write results crossing as checked plain data (``pipeline.saving.steps``), so that no
object collective runs and every wait is bounded by the Pipe's ``timeout`` (PeerError).
As in DCP, the first rank alone reads every rank's plan and write results; each rank
receives only its own share of the merged plan (``pipeline.saving.coordinator``), so a
rank's cost of planning grows with its own entries, not with ranks x entries.
torch's errors reach the caller as a ``CheckpointError`` (a ``ValueError``) whose message
is their first line.

Writes are atomic at the directory level and never delete what they did not write
(``pipeline.saving.target``): ``path`` must be absent, empty, or a checkpoint of
ours, else the save is refused before a byte is written (a user's files, a file, a link,
the current directory). The first rank locks ``path`` for the whole save (a second saver
is refused); every rank writes into ``.<name>.partial`` beside ``path`` (marked by an
``.incomplete`` file), and after a barrier the first rank removes the mark and swaps the
directory into place in one step. A run killed during the save leaves the previous
checkpoint (or none) at ``path``; the leftover is removed by the next save. A directory
without DCP's ``.metadata`` file, or with the mark, is refused. Every rank must see the
same file system.

Loading reads only regular files of the directory (a file replaced by a symbolic link is
refused; the directory itself may be reached through one), and checks every size and
offset the manifest claims against the files' real sizes before it allocates anything
(``pipeline.saving.bounds``). Everything it raises is a ``CheckpointError``, but
for a ``PeerError`` (a peer that did not answer).

Not saved: learning-rate schedulers, gradient scalers, CUDA generators and data-loader
positions (save them beside the checkpoint if needed). The optimizer's hyperparameters
(``lr``, ``betas``...) are saved and restored with its state.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipeline.saving.coordinator import agree, answer, attempt, collect
from pipeline.saving.format import (
    CheckpointError,
    plan_from_plain,
    plan_plain,
    results_from_plain,
    results_plain,
    share_from_plain,
    shares_plain,
)
from pipeline.saving.steps import RankLoad, RankSave
from pipeline.saving.manifest import (
    MANIFEST_FILE,
    METADATA_FILE,
    digest,
    digests_from_plain,
    read_manifest,
    verify,
    write_manifest,
)
from pipeline.saving.target import (
    INCOMPLETE_MARK,
    absolute,
    discard,
    previous_of,
    staging_of,
    take,
)
from pipeline.saving.target import publish as _publish
from pipeline.saving.state import (
    Layout,
    Reading,
    apply,
    check_ties,
    optimizer_state,
    plan_reading,
    save_state,
    tied_groups,
)
from pipeline.group.ranks import OneProcess, RankGroup, Ranks

if TYPE_CHECKING:
    from pipeline.pipe import Pipe

__all__ = ["CheckpointError", "INCOMPLETE_MARK", "MANIFEST_FILE", "METADATA_FILE",
           "check_complete", "load_checkpoint", "load_into_model", "save_checkpoint",
           "save_model_checkpoint"]

@dataclass(frozen=True)
class _Scope:
    """What one process writes or reads, and its peers."""

    layout: Layout  # its layers under their model names, and what it knows of the whole
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
    replaced only once the new checkpoint is complete. Nothing is changed: no optimizer
    step runs, gradients stay where they are.

    Args:
        pipe: a Pipe, in one process or with a group (its runner built: after the first
            step when ``balance="time"`` waited for a batch).
        optimizer: an optimizer over ``pipe.parameters()``, or None for the model alone.
        path: the checkpoint directory.
        step: the training step, returned by ``load_checkpoint``.

    Raises:
        CheckpointError: ``path`` holds something other than a checkpoint of ours (a
            user's files, named; a file; a link), is the current directory or above it,
            another save to it is in progress, it cannot be written (the system's reason),
            the optimizer holds a parameter this rank's layers do not, or a rank failed to
            plan or write its part (on every rank, naming that rank and its error). Nothing
            at ``path`` changed then.
        PeerError: a rank did not take part within the Pipe's timeout.
    """
    _save(_scope_of_pipe(pipe), optimizer, path, step)


def load_checkpoint(pipe: Pipe, optimizer: torch.optim.Optimizer | None,
                    path: str | os.PathLike[str]) -> int:
    """Load a checkpoint of ``save_checkpoint`` into ``pipe`` and ``optimizer``; the step.

    Any cut of the same model loads it: each rank reads the entries of the layers it
    runs, and the optimizer state of their parameters, by name. Every rank of the pipe's
    group calls it. Loading is strict: every key this rank needs is there, no model key
    is foreign to the model, shapes agree, the optimizer is of the kind that saved, and
    a tied parameter's keys hold one value. The files read are checked against the
    digests taken at save. The optimizer's hyperparameters are the checkpoint's
    afterwards. Gradients are kept.

    Raises:
        CheckpointError (a ValueError): no directory at ``path``; not a complete
            checkpoint (no ``.metadata``, or a save that was interrupted); the checkpoint
            does not fit (keys missing or unexpected, another shape, another kind of
            optimizer, a tie it would break); a file is not what was saved, is a link or
            not a regular file, or the manifest claims bytes past its end (naming the
            file); the system failed to read it. With a group, every rank raises, the
            others naming the rank that failed.
        PeerError: a rank did not take part within the Pipe's timeout.
    """
    return _load(_scope_of_pipe(pipe), optimizer, Path(path))


def load_into_model(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    path: str | os.PathLike[str]) -> int:
    """Load a checkpoint into the unpipelined model (``nn.Sequential``) and a plain optimizer.

    Runs in one process, without collectives (even where a process group exists); the
    RNG state restored is rank 0's. Returns the saved step. Raises as ``load_checkpoint``.
    """
    return _load(_one_process(model), optimizer, Path(path))


def save_model_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                          path: str | os.PathLike[str], step: int) -> None:
    """Write the unpipelined model's checkpoint (one process), loadable by any Pipe cut."""
    _save(_one_process(model), optimizer, path, step)


def check_complete(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path when it holds a complete checkpoint.

    ``path`` itself may be a symbolic link to the directory (``latest -> step-1000``); the
    files in it may not (``load_checkpoint`` refuses them).

    Raises:
        CheckpointError: nothing at ``path`` (naming the previous checkpoint a save
            interrupted while replacing it left beside it, if any), not a directory, no
            ``.metadata``, or still marked incomplete.
    """
    directory = Path(path)
    if not directory.exists():
        previous = previous_of(absolute(directory))
        hint = (f"; a save interrupted while replacing it left the previous checkpoint at "
                f"{previous}" if previous.is_dir() else "")
        raise CheckpointError(f"no checkpoint at {directory}{hint}")
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a checkpoint directory (save_checkpoint "
                              f"writes a directory; a single-file state dict loads with "
                              f"torch.load)")
    if (directory / INCOMPLETE_MARK).exists() or not (directory / METADATA_FILE).is_file():
        raise CheckpointError(
            f"{directory} is not a complete checkpoint: "
            + ("it is marked as being written (a save that was interrupted or is still running)"
               if (directory / INCOMPLETE_MARK).exists() else
               f"it has no {METADATA_FILE} file, which a save writes last")
            + "; load the checkpoint it was meant to replace instead"
        )
    return directory


# -- where each rank stands ------------------------------------------------------------------


def _scope_of_pipe(pipe: Pipe) -> _Scope:
    ranks, settings = pipe.ranks, pipe.distributed
    if settings is not None:
        # Data-parallel replicas write the same keys (the plan keeps one copy): all take part.
        ranks = RankGroup(settings.holders, pipe.timeout)
    cut = pipe.cut  # this rank's units under the model's own names
    layout = Layout(cut.view(pipe.local_layers), cut.keys(), cut.ties)
    return _Scope(layout, ranks, pipe.devices[0])


def _one_process(model: nn.Module) -> _Scope:
    layout = Layout(model, frozenset(model.state_dict(keep_vars=True)), tied_groups(model))
    return _Scope(layout, OneProcess(0.0), torch.device("cpu"))


def _check_optimizer(scope: _Scope, optimizer: torch.optim.Optimizer | None) -> None:
    if optimizer is None:
        return
    held = {id(p) for p in scope.layout.module.parameters()}
    foreign = sum(1 for group in optimizer.param_groups for p in group["params"]
                  if id(p) not in held)
    if foreign:
        raise CheckpointError(f"the optimizer holds {foreign} parameter(s) that this rank's "
                              f"layers do not: build it over pipe.parameters()")


# -- saving ----------------------------------------------------------------------------------


def _save(scope: _Scope, optimizer: torch.optim.Optimizer | None,
          path: str | os.PathLike[str], step: int) -> None:
    _check_optimizer(scope, optimizer)
    target = absolute(path)
    staging = staging_of(target)
    lock, failure = attempt(lambda: take(target) if scope.coordinator else None,
                             "preparing the checkpoint directory")
    try:
        agree(scope.ranks, scope.device, failure, "preparing the checkpoint directory")
        _write(scope, optimizer, staging, target, step)
    except Exception:
        if lock is not None:  # an ordinary failure leaves nothing; a killed save, its staging
            discard(staging)
        raise
    finally:
        if lock is not None:
            lock.release()


def _write(scope: _Scope, optimizer: torch.optim.Optimizer | None, staging: Path,
           target: Path, step: int) -> None:
    """Every rank's shards into ``staging``, then the first rank publishes it at ``target``.
    The first rank alone merges the plans and reads the write results
    (``pipeline.saving.coordinator``): a rank handles its own entries only."""
    saving: list[RankSave] = []
    rank, ranks, device = scope.ranks.rank, scope.ranks, scope.device

    def plan() -> dict[str, Any]:
        state = save_state(scope.layout, optimizer, step, rank)
        saving.append(RankSave(state, staging, rank))
        return plan_plain(saving[0].local_plan())

    mine, failure = attempt(plan, "planning the save")
    plans, failure = collect(ranks, mine, failure, "planning the save", device)

    def merge() -> list[dict[str, Any]]:
        assert plans is not None
        local = [plan_from_plain(part, f"rank {r}'s save plan") for r, part in enumerate(plans)]
        return shares_plain(local, saving[0].merge(local))

    shares, failure = attempt(merge, "planning the save") if plans is not None \
        and failure is None else (None, failure)
    share = answer(ranks, shares, failure, "planning the save", device)

    def write() -> dict[str, Any]:
        mine = share_from_plain(share, len(saving[0].local.items), "the save plan's share")
        results = saving[0].write(mine)
        files = {path.name: digest(path) for path in sorted(staging.glob(f"__{rank}_*.distcp"))}
        return {"results": results_plain(results), "files": files}

    mine, failure = attempt(write, "writing its shards")
    written, failure = collect(ranks, mine, failure, "writing its shards", device)

    def finish() -> None:
        if failure is not None:
            raise failure
        if written is None:  # not the first rank
            return
        files: dict[str, dict[str, Any]] = {}
        for r, part in enumerate(written):
            files.update(digests_from_plain(part.get("files"), r))
        metadata = saving[0].finish([results_from_plain(part.get("results"),
                                                        f"rank {r}'s write results")
                                     for r, part in enumerate(written)])
        files[METADATA_FILE] = digest(staging / METADATA_FILE)
        write_manifest(staging, metadata, files)
        _publish(staging, target)

    _, failure = attempt(finish, "publishing the checkpoint")
    # Nobody returns before it is in place.
    agree(scope.ranks, scope.device, failure, "publishing the checkpoint")


# -- loading ---------------------------------------------------------------------------------


def _load(scope: _Scope, optimizer: torch.optim.Optimizer | None, path: Path) -> int:
    _check_optimizer(scope, optimizer)
    directory = check_complete(path)

    def prepare() -> tuple[Reading, RankLoad, RankLoad]:
        metadata, files = read_manifest(directory)
        verify(directory, files, [METADATA_FILE])
        reading = plan_reading(scope.layout, optimizer, metadata, directory, scope.ranks.rank)
        tied = {key: reading.flat[key] for key in reading.tied_keys.values()}
        rest = {key: value for key, value in reading.flat.items() if key not in tied}
        loads = RankLoad(tied, directory, metadata), RankLoad(rest, directory, metadata)
        verify(directory, files, loads[0].files() + loads[1].files())
        return reading, *loads

    prepared, failure = attempt(prepare, "checking the checkpoint")
    agree(scope.ranks, scope.device, failure, "checking the checkpoint")
    assert prepared is not None
    reading, tied, rest = prepared

    # The tied keys first, into placeholders: a tie the checkpoint would break is refused
    # on every rank before anything is read into the model.
    _, failure = attempt(lambda: check_ties(reading, tied.read()), "checking tied weights")
    agree(scope.ranks, scope.device, failure, "checking tied weights")

    def read() -> dict[str, Any] | None:
        reading.flat.update(rest.read())
        return optimizer_state(reading, optimizer)

    optimizer_loaded, failure = attempt(read, "reading the checkpoint")
    agree(scope.ranks, scope.device, failure, "reading the checkpoint")
    return apply(reading, scope.layout, optimizer, optimizer_loaded)
