"""One call at a time: a Pipe's step, forward, prediction or close from several threads.

A step's state (stashed activations, receive buffers, the step's messages) belongs to the
one call running it; a second call from another thread waits for the first to end (which
its own peer timeouts bound), in the order the threads asked. A call made from inside a
running one (a loss function or hook that calls the pipe) cannot wait for itself: it is
refused at once, whether it comes from the calling thread (across ranks the loss runs
there) or from one of the stage threads that run a one-process step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

STAGE_THREAD_PREFIX = "pipesched-stage-"  # the names local_runner gives its stage threads


class OneCall:
    """A lock that names the call holding it, for the message of a re-entrant call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._running = ""

    @contextlib.contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        here = threading.current_thread()
        if self._running and (self._owner == here.ident
                              or here.name.startswith(STAGE_THREAD_PREFIX)):
            raise RuntimeError(
                f"{what} was called from inside {self._running} on the same Pipe (from a loss "
                f"function or a hook?): a Pipe runs one call at a time; call it after "
                f"{self._running} returns"
            )
        with self._lock:
            self._owner, self._running = here.ident, what
            try:
                yield
            finally:
                self._owner, self._running = None, ""
