"""One call at a time: a Pipe's step, forward, prediction or close from several threads.

A step's state (stashed activations, receive buffers, the step's messages) belongs to the
one call running it; a second call from another thread waits for the first to end, in
the order the threads asked, for at most the Pipe's timeout. A call made from inside a
running one (a loss function or hook that calls the pipe) cannot wait for itself: on the
same thread it is refused at once, from a stage's thread when the wait times out.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class OneCall:
    """A lock that names the call holding it, for the message of a re-entrant call."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._running = ""

    @contextlib.contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        if self._owner == threading.get_ident():
            raise RuntimeError(
                f"{what} was called while this thread runs {self._running} on the same Pipe "
                f"(from a loss function or a hook?): a Pipe runs one call at a time; call it "
                f"after {self._running} returns"
            )
        if not self._lock.acquire(timeout=self._timeout):
            raise RuntimeError(
                f"{what} waited {self._timeout:g}s for {self._running} to end (a Pipe runs one "
                f"call at a time); if {what} was called from inside it (a loss function or "
                f"hook), call it after {self._running} returns"
            )
        self._owner, self._running = threading.get_ident(), what
        try:
            yield
        finally:
            self._owner, self._running = None, ""
            self._lock.release()
