"""What a training step changes, set aside so that a failed step leaves none of it.

A step accumulates into ``.grad`` micro-batch by micro-batch and updates
BatchNorm's running statistics as it goes; a layer that raises at micro-batch 3
of 8 would leave both half done, and the next step (gradient accumulation
without ``zero_grad``) would silently train on the remains. So a step starts
from ``.grad = None`` on every parameter it holds, with the previous gradients
set aside (references, no copies), and its norms' running statistics copied
(a few vectors per norm). After a step that succeeded (its cross-stage sums
included), each set-aside gradient gets the step's gradient added in place,
which is what accumulation would have left; after one that failed, the
set-aside gradients and statistics are put back and the step's partial ones
dropped. Summing tied weights' gradients across stages then adds only this
step's part (the set-aside part is the sum already), so accumulation stays
exact there too.

The cost: nothing where gradients were cleared with ``set_to_none=True``
(the default); one addition per accumulated parameter per step otherwise, and
a copy of each running statistic. Other buffers a forward writes (spectral
norm's vectors, say) keep what the failed step's forwards wrote.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pipeline.compute.batchnorm import running_norms

NOTE = ("pipesched: the step's partial gradients were dropped; .grad and running statistics "
        "are as they were before the step")


@dataclass
class StepState:
    """The gradients and running statistics a step started from."""

    grads: list[tuple[nn.Parameter, torch.Tensor | None]]
    statistics: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def set_aside(cls, parameters: Iterable[nn.Parameter], modules: Iterable[nn.Module]) -> StepState:
        """Clear ``.grad`` of ``parameters`` (keeping the old ones) and copy the statistics."""
        grads = []
        for parameter in parameters:
            grads.append((parameter, parameter.grad))
            parameter.grad = None
        statistics = [
            (buffer, buffer.clone())
            for module in modules for norm in running_norms(module)
            for buffer in (norm.running_mean, norm.running_var, norm.num_batches_tracked)
            if buffer is not None
        ]
        return cls(grads, statistics)

    def merge(self) -> None:
        """After a successful step: the set-aside gradients plus the step's."""
        with torch.no_grad():
            for parameter, before in self.grads:
                if before is None:
                    continue
                if parameter.grad is not None:
                    before.add_(parameter.grad)
                parameter.grad = before
        self.grads, self.statistics = [], []

    def restore(self, error: BaseException) -> None:
        """After a failed step: everything as before it; ``error`` says so in a note."""
        for parameter, before in self.grads:
            parameter.grad = before
        with torch.no_grad():
            for buffer, value in self.statistics:
                buffer.copy_(value)
        self.grads, self.statistics = [], []
        error.add_note(NOTE)
