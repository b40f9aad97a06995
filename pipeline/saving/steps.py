"""One rank's part of a DCP save or load, step by step, with no collective and no unpickling.

``torch.distributed.checkpoint.save`` and ``load`` coordinate ranks through object
collectives (pickles from peers) and read ``.metadata`` with ``pickle.load``. Their
planners and file storage are public extension points, so this module runs the same
steps for one rank: the caller carries the plans and write results between ranks as
checked plain data (``pipeline.saving.format``), under the Pipe's timeout, and hands
the load the index it read from the manifest. Every rank computes the same global plan
from the same gathered plans (DCP's planner is deterministic), so nothing is scattered.

Bytes entries (an optimizer's hyperparameters) are read with ``torch.load(...,
weights_only=True)``; DCP's default planner would read them with ``weights_only=False``.
DCP's reader opens each data file as a regular file of the directory, never through a
link (``pipeline.saving.manifest.open_regular``): a file swapped for a link after it
was verified is refused too.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
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
        self.metadata: Metadata | None = None

    def local_plan(self) -> SavePlan:
        """What this rank holds, before replicas' duplicates are dropped."""
        plan: SavePlan = self.writer.prepare_local_plan(self.planner.create_local_plan())
        return plan

    def write(self, plans: Sequence[SavePlan]) -> list[WriteResult]:
        """Write this rank's share of the global plan made from every rank's ``plans``."""
        global_plans, self.metadata = self.planner.create_global_plan(list(plans))
        global_plans = self.writer.prepare_global_plan(global_plans)  # files __<rank>_*.distcp
        plan = self.planner.finish_plan(global_plans[self.rank])
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
