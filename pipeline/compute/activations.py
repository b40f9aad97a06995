"""Measure the activation memory a stage holds, per micro-batch, with saved-tensor hooks."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.compute.dtensors import is_dtensor

Key = tuple[int, int]  # (microbatch, chunk)
View = tuple[Key, int, int, tuple[int, ...], tuple[int, ...]]  # key, storage, offset, shape, stride
Region = tuple[Key, int]  # (key, storage): the views of one storage saved for one key


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

    A tensor is counted once however many saved aliases of it there are (an output saved
    by its own op and by the next one), and views of one storage saved for one key count
    the bytes they span together, once (attention saves its output, and the next Linear
    the same memory seen 2-D); each is released by a weakref callback when its last
    alias goes, so the figures follow real lifetimes, not bookkeeping. Parameters and
    views of them (Linear saves ``weight.t()``) are excluded: they live anyway.
    """

    def __init__(self, parameters: Iterable[torch.Tensor], chunk_share: float) -> None:
        self._parameters = list(parameters)
        self._parameter_storages: set[int] = set()
        self._share = chunk_share
        self._lock = threading.Lock()
        self._tracked: dict[View, int] = {}  # view -> aliases alive
        self._regions: dict[Region, dict[View, tuple[int, int]]] = {}  # view -> bytes spanned
        self._region_bytes: dict[Region, int] = {}
        # id(weakref) -> (the weakref, its view): a weakref with a callback is a fraction
        # of the cost of weakref.finalize, paid for every saved tensor of every micro-batch.
        self._watched: dict[int, tuple[weakref.ref[torch.Tensor], View]] = {}
        self._live_bytes: dict[Key, int] = {}
        self._bytes = 0
        self._peak_bytes = 0
        self._peak_held = 0.0
        self.measuring = False  # Pipe.measure_memory turns it on: a hook per saved tensor

    def report(self) -> MemoryReport:
        with self._lock:
            return MemoryReport(round(self._peak_held, 9), self._peak_bytes)

    def live_bytes(self) -> int:
        """Bytes tracked and still alive now."""
        with self._lock:
            return self._bytes

    def reset_peaks(self) -> None:
        with self._lock:
            # Read once a step: moving a model to its device gives parameters new storage.
            self._parameter_storages = {_storage(p) for p in self._parameters}
            self._peak_bytes = self._bytes
            self._peak_held = len(self._live_bytes) * self._share

    def track(self, key: Key, tensor: torch.Tensor) -> None:
        """Count ``tensor`` against ``key`` until it (and every alias tracked with it) is freed."""
        storage = _storage(tensor)
        if storage in self._parameter_storages:
            return
        if tensor.numel() * tensor.element_size() == 0:
            return
        view = (key, storage, int(tensor.storage_offset()), tuple(tensor.shape),
                tuple(tensor.stride()))
        with self._lock:
            aliases = self._tracked.get(view)
            self._tracked[view] = (aliases or 0) + 1
            if aliases is None:
                self._regions.setdefault((key, storage), {})[view] = _span(tensor)
                self._recount((key, storage))
            watch = weakref.ref(tensor, self._freed)
            self._watched[id(watch)] = (watch, view)

    def _freed(self, watch: weakref.ref[torch.Tensor]) -> None:
        with self._lock:
            _, view = self._watched.pop(id(watch))
            self._tracked[view] -= 1
            if self._tracked[view]:
                return
            del self._tracked[view]
            region = (view[0], view[1])
            del self._regions[region][view]
            self._recount(region)

    def _recount(self, region: Region) -> None:
        """Bring the totals up to date with what ``region``'s views span now (lock held)."""
        views = self._regions[region]
        now = _union(views.values())
        delta = now - self._region_bytes.get(region, 0)
        if not views:
            del self._regions[region]
            self._region_bytes.pop(region, None)
        else:
            self._region_bytes[region] = now
        key = region[0]
        remaining = self._live_bytes.get(key, 0) + delta
        if remaining:
            self._live_bytes[key] = remaining
        else:
            self._live_bytes.pop(key, None)
        self._bytes += delta
        self._peak_bytes = max(self._peak_bytes, self._bytes)
        self._peak_held = max(self._peak_held, len(self._live_bytes) * self._share)

    @contextmanager
    def recording(self, key: Key) -> Iterator[None]:
        """Within the body, every tensor autograd saves counts against ``key``.

        Saved-tensor hooks already active (``torch.autograd.graph.save_on_cpu()``, say)
        still apply: only the innermost hooks run, so these call them in turn.
        """
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

        def pack(tensor: torch.Tensor) -> Any:
            # A detached alias, never ``tensor`` itself: a saved output would hold its own
            # grad_fn, a cycle through C++ that no garbage collector frees, so with
            # retain_graph=True (split backward) activations leaked for good
            # (pytorch/pytorch#115255). Autograd restores the grad_fn on unpack.
            packed = tensor.detach()
            self.track(key, packed)
            return packed if outer is None else outer[0](packed)

        def unpack(packed: Any) -> torch.Tensor:
            return packed if outer is None else outer[1](packed)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` of its storage that a (non-empty) view reaches."""
    size = tensor.element_size()
    start = int(tensor.storage_offset()) * size
    reach = 1 + sum((n - 1) * abs(stride) for n, stride in zip(tensor.shape, tensor.stride()))
    return start, start + reach * size


def _union(spans: Iterable[tuple[int, int]]) -> int:
    """Bytes covered by the union of ``spans``."""
    total, end = 0, -1
    for start, stop in sorted(spans):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def _storage(tensor: torch.Tensor) -> int:
    """Where ``tensor``'s bytes are (a DTensor's: its local shard's, which a traced unit's
    graph reads and autograd saves)."""
    if is_dtensor(tensor):
        tensor = tensor.to_local()
    return tensor.untyped_storage().data_ptr()
