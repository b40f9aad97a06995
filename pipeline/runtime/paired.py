"""An overlapped pair run in turns: the backward computes while the forward's all-to-all is in flight, and the other way round.

A pair (``schedules.pairs``) is a forward of one micro-batch and a backward of another on
one stage. In an expert-parallel model each stops at every token exchange
(``units.ep_dispatch``): it issues an all-to-all and waits for it. Run one after the
other, every wait is exposed. Run in turns, each wait is covered by the other's
computation:

1. the backward runs (autograd drives it) until it has issued an exchange;
2. it gives the turn to the forward, which runs until it has issued one of its own (or
   ends) and gives the turn back;
3. the backward waits for its exchange, by now mostly or wholly done, and goes on.

Exactly one of the two runs at any moment: the turns are handed over at fixed points (each
exchange's issue), the same on every rank of the ``ep`` group, so every rank issues the
group's all-to-alls in one order and no collective can pass another (NCCL's rule). The
forward runs on a thread of its own only to keep its own call stack and thread-local
state (grad mode, saved-tensor hooks, autocast, the CUDA device and stream: the caller's,
captured at the pair's start, as a stage thread gets them), not to run at the same
time: recomputation and selective checkpointing see what they see in any forward. The
time each one computed is measured, so the pair's two events share its interval in that
proportion.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pipeline.runtime.context import CallerState

_here = threading.local()  # .turns on a pair's forward thread; .pair on its backward's


class PairCancelled(BaseException):
    """Raised in a pair's forward thread when its backward failed: the forward unwinds."""


class Turns:
    """A pair's forward, run on its own thread in the turns the backward gives it."""

    def __init__(self, forward: Callable[[], Any]) -> None:
        self._forward = forward
        self._go = threading.Semaphore(0)
        self._back = threading.Semaphore(0)
        self._state = CallerState.capture()
        self._cuda = _cuda_place()
        self._cancelled = False
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.computed = 0.0  # seconds the forward ran in its turns
        self._thread = threading.Thread(target=self._run, name="pipesched-pair-forward",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._go.acquire()
        _here.turns = self
        began = time.perf_counter()
        try:
            if self._cancelled:
                raise PairCancelled()
            with self._state.applied(), _on_cuda(self._cuda):
                self.result = self._forward()
        except BaseException as error:  # handed to the backward's thread
            self.error = error
        finally:
            self.computed += time.perf_counter() - began
            self.done = True
            self._back.release()

    def give(self) -> None:
        """The backward's thread: let the forward run until it gives the turn back."""
        if not self.done:
            self._go.release()
            self._back.acquire()

    def give_back(self) -> None:
        """The forward's thread: return the turn, and wait for the next one."""
        now = time.perf_counter()
        self._back.release()
        self._go.acquire()
        if self._cancelled:
            raise PairCancelled()
        self.computed -= time.perf_counter() - now  # the wait was not the forward's

    def finish(self) -> Any:
        """Run the forward to its end; its result (its error raised here)."""
        while not self.done:
            self.give()
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.result

    def cancel(self) -> None:
        """Unwind the forward wherever it waits for a turn (the backward failed)."""
        self._cancelled = True
        while not self.done:
            self.give()
        self._thread.join()


def _cuda_place() -> tuple[int, Any] | None:
    """The calling thread's CUDA device and stream (thread-local in torch), if CUDA runs."""
    if not torch.cuda.is_available():
        return None
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return None
    return torch.cuda.current_device(), torch.cuda.current_stream()


@contextmanager
def _on_cuda(place: tuple[int, Any] | None) -> Iterator[None]:
    """The forward's thread on the backward's device and stream: one stream, in turns."""
    if place is None:
        yield
        return
    device, stream = place
    torch.cuda.set_device(device)
    with torch.cuda.stream(stream):
        yield


def while_in_flight() -> bool:
    """An exchange has issued an all-to-all and is about to wait for it: the other side of
    a pair, if one runs and has not ended, takes its turn now; whether it did. Nothing
    happens outside a pair."""
    turns = getattr(_here, "turns", None)
    if turns is not None:
        turns.give_back()
        return True
    pair = getattr(_here, "pair", None)
    if pair is not None and not pair.done:
        pair.give()
        return True
    return False


def run_pair(forward: Callable[[], Any], backward: Callable[[], Any]
             ) -> tuple[Any, Any, float]:
    """Run ``backward`` here and ``forward`` in the turns its exchanges leave; their results
    and the seconds the forward computed."""
    turns = Turns(forward)
    _here.pair = turns
    try:
        backward_result = backward()
    except BaseException:
        turns.cancel()
        raise
    finally:
        _here.pair = None
    forward_result = turns.finish()
    return forward_result, backward_result, turns.computed
