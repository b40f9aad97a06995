"""Run pipeline schedules on real tensors: threads in one process, or one stage per rank."""

from pipeline.compute.activations import MemoryReport
from pipeline.errors import PeerError, PipelineAborted, StageError
from pipeline.group.distributed import Distributed
from pipeline.group.process_groups import make_groups
from pipeline.pipe import Pipe
from pipeline.saving import gather_state_dict, save_state_dict

__all__ = [
    "Distributed",
    "MemoryReport",
    "PeerError",
    "Pipe",
    "PipelineAborted",
    "StageError",
    "gather_state_dict",
    "make_groups",
    "save_state_dict",
]
