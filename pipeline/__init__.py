"""Run pipeline schedules on real tensors: threads in one process, or one stage per rank."""

from pipeline.transports.base import PeerError
from pipeline.process_groups import make_groups
from pipeline.memory import MemoryReport
from pipeline.pipe import Pipe
from pipeline.stage import StageError
from pipeline.state import gather_state_dict, save_state_dict
from pipeline.transports.base import PipelineAborted

__all__ = [
    "MemoryReport",
    "PeerError",
    "Pipe",
    "PipelineAborted",
    "StageError",
    "gather_state_dict",
    "make_groups",
    "save_state_dict",
]
