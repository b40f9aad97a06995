"""The error for a memory limit that no cut or plan meets, with the smallest that would."""

from __future__ import annotations

from typing import Any


class MemoryLimitError(ValueError):
    """No cut (``balance``) or plan (``plan``) fits ``memory_limit`` per stage.

    A ``ValueError``, so code catching that keeps working; the message names the smallest
    limit as well, for people.

    Attributes:
        smallest_limit: the smallest per-stage limit, in whole bytes, that one would fit.
    """

    def __init__(self, message: str, smallest_limit: int) -> None:
        super().__init__(message)
        self.smallest_limit = smallest_limit

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.smallest_limit)
