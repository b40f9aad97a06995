"""The errors a Pipe raises on its own account: a failed layer, a failed peer, an aborted stage."""

from __future__ import annotations


class PeerError(RuntimeError):
    """A peer rank failed, died, sent a corrupt message or did not answer in time.

    ``rank`` names the rank at fault where one is known; None where none is (a collective
    some rank did not join, a group an earlier step broke).
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class PipelineAborted(RuntimeError):
    """Raised in a stage that was waiting when another stage (of this process) failed."""


class StageError(RuntimeError):
    """An exception raised inside a stage, with the stage, layer and micro-batch that raised it."""
