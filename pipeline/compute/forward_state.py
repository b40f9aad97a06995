"""Buffers a forward writes, put back in place for a recomputation to see what the forward saw.

Some layers update state in their forward: BatchNorm's running statistics, spectral
norm's power-iteration vectors (``parametrizations.spectral_norm`` refines ``_u`` and
``_v`` in place on every training forward, then normalises the weight with them). A
recomputation that ran with the state as it is by then would compute another weight
than the forward did, and update the state a second time. So before the forward of a
micro-batch that will be recomputed, the buffers a forward writes are copied; the
recomputation runs with those copies in place and the live values are put back after
it. Which buffers a forward writes is found, not declared: by their version counters
(every in-place write bumps one) across the first recomputed forward; until then every
buffer is copied once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

Snapshot = dict[str, torch.Tensor]


class WrittenBuffers:
    """The buffers of ``module`` that its forward writes, and copies of them."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._known: set[str] | None = None  # learned on the first recomputed forward

    def snapshot(self) -> tuple[Snapshot, dict[str, tuple[int, int]]]:
        """Copies of the buffers a forward may write, and every buffer's (identity, version)."""
        buffers = dict(self._module.named_buffers())
        marks = {name: (id(t), t._version) for name, t in buffers.items()}
        names = buffers if self._known is None else self._known
        return {name: buffers[name].clone() for name in names if name in buffers}, marks

    def learn(self, snapshot: Snapshot, marks: dict[str, tuple[int, int]]) -> Snapshot:
        """After the forward ``snapshot`` preceded: note what it wrote; keep only that."""
        written = {name for name, t in self._module.named_buffers()
                   if marks.get(name) != (id(t), t._version)}
        self._known = written if self._known is None else self._known | written
        return {name: value for name, value in snapshot.items() if name in self._known}

    @contextmanager
    def replayed(self, snapshot: Snapshot | None) -> Iterator[None]:
        """Within the body the buffers hold ``snapshot``; afterwards their live values."""
        if not snapshot:
            yield
            return
        live = []
        with torch.no_grad():
            for name, value in snapshot.items():
                owner, _, attribute = name.rpartition(".")
                module = self._module.get_submodule(owner)
                tensor = getattr(module, attribute)
                live.append((module, attribute, tensor, tensor.clone()))
                tensor.copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                for module, attribute, tensor, value in live:
                    setattr(module, attribute, tensor)
                    tensor.copy_(value)
