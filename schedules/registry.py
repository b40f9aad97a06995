"""Look up a schedule generator by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from schedules.action import Schedule
from schedules.gpipe import gpipe
from schedules.interleaved import interleaved_1f1b
from schedules.onefoneb import one_f_one_b
from schedules.zero_bubble import zero_bubble_h1, zero_bubble_h2
from schedules.zero_bubble_v import zero_bubble_v

GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zero_bubble_h1,
    "zb-h2": zero_bubble_h2,
    "zb-v": zero_bubble_v,
}


def schedule_names() -> tuple[str, ...]:
    """The names ``get_schedule`` knows."""
    return tuple(GENERATORS)


def get_schedule(name: str, stages: int, microbatches: int, **options: Any) -> Schedule:
    """Build the schedule called ``name`` (see ``schedule_names()``).

    Args:
        name: e.g. ``"gpipe"`` or ``"1f1b"``; case and ``_``/``-`` are not significant.
        stages: number of pipeline stages.
        microbatches: number of micro-batches per step.
        **options: passed to the generator (e.g. ``chunks_per_stage``).

    Raises:
        ValueError: an unknown name (the message lists the known ones), or bad counts.
    """
    key = str(name).strip().lower().replace("_", "-")
    if key not in GENERATORS:
        known = ", ".join(GENERATORS)
        raise ValueError(f"unknown schedule {name!r}; expected one of: {known}")
    return GENERATORS[key](stages, microbatches, **options)
