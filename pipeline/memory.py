"""Measure the activation memory a stage holds, per micro-batch, with saved-tensor hooks."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

Key = tuple[int, int]  # (microbatch, chunk)


@dataclass(frozen=True)
class MemoryReport:
    """What one stage held during a step.

    Attributes:
        peak_activations: the most micro-batches whose activations were alive at
            once (a chunk of a stage with v chunks counts 1/v), comparable with
            ``Timeline.peak_activations``.
        peak_bytes: the most bytes of saved activations (and stashed stage inputs)
            alive at once.
    """

    peak_activations: float
    peak_bytes: int


class ActivationTracker:
    """Counts the bytes autograd saves for each (micro-batch, chunk) while they stay alive.

    Tensors are tracked by identity and released by a weakref finalizer when the
    last reference goes, so the figures follow real lifetimes, not bookkeeping.
    Parameters (saved by layers such as Linear) are excluded: they live anyway.
    """

    def __init__(self, parameters: Iterable[torch.Tensor], chunk_share: float) -> None:
        self._parameters = {id(p) for p in parameters}
        self._share = chunk_share
        self._lock = threading.Lock()
        self._tracked: dict[int, tuple[Key, int]] = {}
        self._live_bytes: dict[Key, int] = {}
        self._bytes = 0
        self._peak_bytes = 0
        self._peak_held = 0.0

    def report(self) -> MemoryReport:
        with self._lock:
            return MemoryReport(round(self._peak_held, 9), self._peak_bytes)

    def reset_peaks(self) -> None:
        with self._lock:
            self._peak_bytes = self._bytes
            self._peak_held = len(self._live_bytes) * self._share

    def track(self, key: Key, tensor: torch.Tensor) -> None:
        """Count ``tensor`` against ``key`` until it is freed."""
        if id(tensor) in self._parameters or id(tensor) in self._tracked:
            return
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return
        with self._lock:
            self._tracked[id(tensor)] = (key, nbytes)
            self._live_bytes[key] = self._live_bytes.get(key, 0) + nbytes
            self._bytes += nbytes
            self._peak_bytes = max(self._peak_bytes, self._bytes)
            self._peak_held = max(self._peak_held, len(self._live_bytes) * self._share)
        weakref.finalize(tensor, self._release, id(tensor))

    def _release(self, tensor_id: int) -> None:
        with self._lock:
            key, nbytes = self._tracked.pop(tensor_id)
            remaining = self._live_bytes[key] - nbytes
            if remaining:
                self._live_bytes[key] = remaining
            else:
                del self._live_bytes[key]
            self._bytes -= nbytes

    @contextmanager
    def recording(self, key: Key) -> Iterator[None]:
        """Within the body, every tensor autograd saves counts against ``key``."""

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            self.track(key, tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
