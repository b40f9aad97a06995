"""Real gloo process groups on localhost for the distributed tests (see pipeline.launching).

``run_ranks`` and ``run_ranks_raw`` are the launcher's, with the fork server preloading
torch and pipeline (``PRELOAD``): the tests start hundreds of ranks. Tests outside
tests/pipeline import them as ``tests.pipeline.helpers.dist_harness``."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from pipeline import launching
from pipeline.launching import PRELOAD, free_port

__all__ = ["free_port", "in_turn", "outcome", "run_ranks", "run_ranks_raw"]


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0,
              threads: int = 1, pin: bool = False) -> list[Any]:
    """``pipeline.launching.run_ranks``, preloading ``PRELOAD``."""
    return launching.run_ranks(fn, world, *args, timeout=timeout, threads=threads, pin=pin,
                               preload=PRELOAD)


def run_ranks_raw(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0,
                  threads: int = 1, pin: bool = False) -> dict[int, tuple[str, Any]]:
    """``pipeline.launching.run_ranks_raw``, preloading ``PRELOAD``."""
    return launching.run_ranks_raw(fn, world, *args, timeout=timeout, threads=threads, pin=pin,
                                   preload=PRELOAD)


def in_turn(rank: int, world: int,
            calls: Sequence[tuple[Callable[..., Any], tuple[Any, ...]]]) -> list[Any]:
    """Several rank functions in one spawn, ``(function, args)`` each, results in order.

    Spawning ranks costs seconds each time (a process, torch's import, a process group);
    the calls share the group, so each must leave it usable for the next (a call that
    breaks a pipeline on purpose goes last)."""
    return [function(rank, world, *args) for function, args in calls]


def outcome(call: Callable[[], Any], limit: int | None = None) -> tuple[str, float]:
    """Run ``call`` on this rank: ``"returned"``, or the error it raised as ``"Type: message"``
    (the message cut at ``limit`` characters), and the seconds it took."""
    started = time.monotonic()
    try:
        call()
        said = "returned"
    except Exception as error:  # noqa: BLE001 - what the tests inspect
        said = f"{type(error).__name__}: {str(error)[:limit]}"
    return said, time.monotonic() - started
