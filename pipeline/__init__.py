"""Run pipeline schedules on real tensors: threads in one process, or one stage per rank.

The public names, one list (``__all__``), each documented in ``docs/api.md``'s pipeline
section (``tests/test_public_face.py`` holds the two together).
"""

from pipeline.compute.activations import MemoryReport
from pipeline.compute.loss import SummedLoss
from pipeline.compute.sample import Sample
from pipeline.errors import PeerError, PipelineAborted, StageError
from pipeline.group.distributed import Distributed
from pipeline.group.process_groups import make_groups
from pipeline.pipe import Pipe
from pipeline.runtime.freed_pages import keep_freed_pages
from pipeline.saving.checkpoints import (CheckpointError, load_checkpoint, load_into_model,
                                         save_checkpoint, save_model_checkpoint)
from pipeline.saving.state_dict import gather_state_dict, save_state_dict

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
    "keep_freed_pages",
    "load_checkpoint",
    "load_into_model",
    "make_groups",
    "save_checkpoint",
    "save_model_checkpoint",
    "save_state_dict",
]
