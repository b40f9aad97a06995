"""BatchNorm under micro-batches: statistics updated once per micro-batch, or once per batch.

A recomputed forward runs every layer a second time; a BatchNorm in training mode
would update its running statistics again, so each micro-batch would count twice.
``frozen_statistics`` puts the running statistics back after a recomputation.

With ``deferred_batch_norm=True`` (torchgpipe's name), the micro-batch forwards
normalise with their own batch statistics, as always, but leave the running
statistics alone; each BatchNorm instead accumulates the per-channel sum, sum of
squares and count of its inputs, and ``DeferredStatistics.commit`` updates the
running mean, running variance and ``num_batches_tracked`` once, as one forward
of the whole batch would have.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

_NormBase = nn.modules.batchnorm._NormBase
_BatchNorm = nn.modules.batchnorm._BatchNorm


def running_norms(module: nn.Module) -> list[_NormBase]:
    """The normalisation layers of ``module`` that keep running statistics."""
    return [m for m in module.modules() if isinstance(m, _NormBase) and m.track_running_stats]


@contextmanager
def frozen_statistics(norms: list[_NormBase]) -> Iterator[None]:
    """Within the body, running statistics may change; afterwards they are as before."""
    if not norms:
        yield
        return
    saved = [
        [(buffer, buffer.clone()) for buffer in (m.running_mean, m.running_var, m.num_batches_tracked)
         if buffer is not None]
        for m in norms
    ]
    try:
        yield
    finally:
        # Through ``.data``: the forward saved these buffers for its backward, and a tracked
        # in-place write would make that backward refuse them (a training-mode backward
        # does not read them, so the values it finds do not matter).
        for pairs in saved:
            for buffer, value in pairs:
                buffer.data.copy_(value)


class DeferredStatistics:
    """Accumulates a chunk's BatchNorm input statistics over a step and commits them once."""

    def __init__(self, module: nn.Module) -> None:
        self.norms = [m for m in running_norms(module) if isinstance(m, _BatchNorm)]
        self._sums: dict[int, list[Any]] = {}

    def begin_step(self) -> None:
        self._sums = {}

    @contextmanager
    def recording(self, record: bool) -> Iterator[None]:
        """Run the body with running statistics untouched; with ``record``, sum the inputs."""
        norms = [m for m in self.norms if m.training]
        if not norms:
            yield
            return
        handles = [m.register_forward_pre_hook(self._accumulate) for m in norms] if record else []
        for m in norms:
            m.track_running_stats = False
        try:
            yield
        finally:
            for m in norms:
                m.track_running_stats = True
            for handle in handles:
                handle.remove()

    def _accumulate(self, module: nn.Module, inputs: tuple[Any, ...]) -> None:
        data = inputs[0].detach().double()
        dims = [d for d in range(data.dim()) if d != 1]
        count = data.numel() // max(1, data.shape[1])
        entry = self._sums.get(id(module))
        with torch.no_grad():
            # Sums around the first micro-batch's mean: no cancellation when mean >> spread.
            shift = data.mean(dims, keepdim=True) if entry is None else entry[3]
            centred = data - shift
            total, squares = centred.sum(dims), (centred * centred).sum(dims)
        if entry is None:
            self._sums[id(module)] = [total, squares, count, shift]
        else:
            entry[0] += total
            entry[1] += squares
            entry[2] += count

    def commit(self) -> None:
        """Update each BatchNorm's running statistics as one full-batch forward would."""
        with torch.no_grad():
            for m in self.norms:
                entry = self._sums.pop(id(m), None)
                if entry is None:
                    continue
                total, squares, count, shift = entry
                tracked, running_mean, running_var = (
                    m.num_batches_tracked, m.running_mean, m.running_var)
                # running_norms keeps only layers that track running statistics.
                assert tracked is not None and running_mean is not None \
                    and running_var is not None
                centred_mean = total / count
                mean = centred_mean + shift.reshape(-1)
                variance = (squares - count * centred_mean * centred_mean) / max(1, count - 1)
                tracked.add_(1)
                momentum = m.momentum
                factor = 1.0 / float(tracked) if momentum is None else momentum
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                running_var.mul_(1 - factor).add_(variance.to(running_var.dtype), alpha=factor)
