"""Run pipeline schedules on real tensors: threads in one process, or one stage per rank."""

from pipeline.checkpoints import CheckpointError, load_checkpoint, load_into_model, save_checkpoint
from pipeline.compute.activations import MemoryReport
from pipeline.compute.loss import SummedLoss
from pipeline.errors import PeerError, PipelineAborted, StageError
from pipeline.group.distributed import Distributed
from pipeline.group.process_groups import make_groups
from pipeline.pipe import Pipe
from pipeline.saving import gather_state_dict, save_state_dict
from pipeline.setup.arguments import Sample

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
