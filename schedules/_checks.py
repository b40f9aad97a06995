"""Argument checks shared by the schedule generators."""

from __future__ import annotations


def check_counts(stages: int, microbatches: int) -> None:
    """Raise ValueError unless both counts are integers of at least one."""
    for name, value in (("stages", stages), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {name}={value}")
