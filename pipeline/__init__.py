"""Run pipeline schedules on real tensors: threads in one process, or one stage per rank.

The checkpoint names (``save_checkpoint``, ``load_checkpoint``, ``load_into_model``,
``CheckpointError``) are imported on first use: they pull in torch's distributed
checkpoint and DTensor (0.7 s of a 2 s import here), which a rank that never saves
does not need.
"""

from typing import TYPE_CHECKING, Any

from pipeline.compute.activations import MemoryReport
from pipeline.compute.loss import SummedLoss
from pipeline.errors import PeerError, PipelineAborted, StageError
from pipeline.group.distributed import Distributed
from pipeline.group.process_groups import make_groups
from pipeline.pipe import Pipe
from pipeline.saving import gather_state_dict, save_state_dict
from pipeline.setup.arguments import Sample

if TYPE_CHECKING:
    from pipeline.checkpoints import (CheckpointError, load_checkpoint, load_into_model,
                                      save_checkpoint)

_CHECKPOINT_NAMES = ("CheckpointError", "load_checkpoint", "load_into_model", "save_checkpoint")


def __getattr__(name: str) -> Any:
    if name in _CHECKPOINT_NAMES:
        from pipeline import checkpoints

        return getattr(checkpoints, name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "Distributed",
    "MemoryReport",
    "PeerError",
    "Pipe",
    "PipelineAborted",
    "Sample",
    "StageError",
    "SummedLoss",
    "gather_state_dict",
    "load_checkpoint",
    "load_into_model",
    "make_groups",
    "save_checkpoint",
    "save_state_dict",
]
