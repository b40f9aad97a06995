"""One rank's part of a DCP save or load, step by step, with no collective and no unpickling.

``torch.distributed.checkpoint.save`` and ``load`` coordinate ranks through object
collectives (pickles from peers) and read ``.metadata`` with ``pickle.load``. Their
planners and file storage are public extension points, so this module runs the same
steps for one rank: the caller carries the plans and write results between ranks as
checked plain data (``pipeline.saving.format``), under the Pipe's timeout, and hands
the load the index it read from the manifest. As in DCP, the first rank alone merges
the local plans (``merge``) and keeps the index; each rank writes the share of its own
plan the merge gave it (``write``), so no rank but the first handles another's entries
(``pipeline.saving.coordinator``).

Bytes entries (an optimizer's hyperparameters) are read with ``torch.load(...,
weights_only=True)``; DCP's default planner would read them with ``weights_only=False``.
DCP's reader opens each data file as a regular file of the directory, never through a
link (``pipeline.saving.manifest.open_regular``): a file swapped for a link after it
was verified is refused too.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
# DCP's writer names its files by the plan's private _StoragePrefix: built here, as its
# prepare_global_plan builds it for rank r on the coordinator ("__<r>_").
from torch.distributed.checkpoint.filesystem import (FileSystem, FileSystemReader,
                                                     FileSystemWriter, _StoragePrefix)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem, SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from pipeline.saving.format import CheckpointError
from pipeline.saving.manifest import open_regular


class RankSave:
    """This rank's save of ``state`` into ``directory`` (one of ``size`` ranks)."""

    def __init__(self, state: dict[str, Any], directory: Path, rank: int) -> None:
        self.rank = rank
        self.coordinator = rank == 0
        self.planner = DefaultSavePlanner()
        self.writer = FileSystemWriter(directory)
        self.planner.set_up_planner(state_dict=state, storage_meta=self.writer.storage_meta(),
                                    is_coordinator=self.coordinator)
        self.writer.set_up_storage_writer(self.coordinator, rank=rank, use_collectives=True)
        self.metadata: Metadata | None = None  # the first rank's, once merged
        self.local = SavePlan([])

    def local_plan(self) -> SavePlan:
        """What this rank holds, before replicas' duplicates are dropped."""
        self.local = self.writer.prepare_local_plan(self.planner.create_local_plan())
        return self.local

    def merge(self, plans: Sequence[SavePlan]) -> list[SavePlan]:
        """The first rank's part: every rank's share of the global plan made from every
        rank's local ``plans`` (DCP's coordinator step); keeps the checkpoint's index."""
        merged, self.metadata = self.planner.create_global_plan(list(plans))
        return merged

    def write(self, share: Sequence[tuple[int, int | None]]) -> list[WriteResult]:
        """Write this rank's ``share`` of the global plan: the items of its local plan at
        those positions, with the index hints the merge gave them, into its own files
        (``__<rank>_*.distcp``, as DCP's writer names them)."""
        local = self.local
        items = [dataclasses.replace(local.items[position], index=dataclasses.replace(
            local.items[position].index, index=hint)) for position, hint in share]
        plan = self.planner.finish_plan(dataclasses.replace(
            local, items=items, storage_data=_StoragePrefix(f"__{self.rank}_")))
        written = self.writer.write_data(plan, self.planner)
        written.wait()
        results: list[WriteResult] = written.value()
        return results

    def finish(self, results: Sequence[Sequence[WriteResult]]) -> Metadata:
        """Write DCP's ``.metadata`` (on the first rank) from every rank's ``results``."""
        assert self.metadata is not None, "write() comes first"
        self.writer.finish(metadata=self.metadata, results=[list(r) for r in results])
        return self.metadata


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner over a flat state dict, reading bytes entries as weights only."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


class _RegularFiles(FileSystem):
    """DCP's file system for reading, opening regular files only (no link, no FIFO)."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if mode != "rb":
            raise CheckpointError(f"a load only reads, got mode {mode!r} for {path}")
        with open_regular(Path(path)) as stream:
            yield stream


class RankLoad:
    """This rank's load of the flat ``state`` (checkpoint keys -> placeholders) from
    ``directory``, whose index ``metadata`` came from the checked manifest."""

    def __init__(self, state: dict[str, Any], directory: Path, metadata: Metadata) -> None:
        self.state = state
        self.planner = _WeightsOnlyLoadPlanner()
        self.reader = FileSystemReader(directory)
        self.reader.fs = _RegularFiles()
        self.planner.set_up_planner(state, metadata, True)
        self.reader.set_up_storage_reader(metadata, True)
        plan = self.reader.prepare_local_plan(self.planner.create_local_plan())
        plan = self.reader.prepare_global_plan(self.planner.create_global_plan([plan]))[0]
        self.plan = self.planner.finish_plan(plan)

    def files(self) -> list[str]:
        """The data files this rank's reads touch."""
        return sorted({self.reader.storage_data[item.storage_index].relative_path
                       for item in self.plan.items})

    def read(self) -> dict[str, Any]:
        """Fill the placeholders (tensors in place, bytes entries replaced); the state."""
        self.reader.read_data(self.plan, self.planner).wait()
        return self.state
