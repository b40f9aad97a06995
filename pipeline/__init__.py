"""Run pipeline schedules on real tensors: threads in one process, or one stage per rank."""

from pipeline.memory import MemoryReport
from pipeline.pipe import Pipe
from pipeline.stage import StageError
from pipeline.transport import PipelineAborted

__all__ = ["MemoryReport", "Pipe", "PipelineAborted", "StageError"]
