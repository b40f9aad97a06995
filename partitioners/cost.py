"""LayerCost: what one layer of a model costs in time and memory, as measured by ``profile``."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerCost:
    """The measured cost of one layer, for one micro-batch.

    Attributes:
        forward: seconds of the forward pass.
        backward: seconds of the backward pass (input and weight gradients).
        param_bytes: bytes of the layer's parameters.
        activation_bytes: bytes of the layer's output, what a cut after it sends.
        saved_bytes: bytes autograd keeps for the layer's backward (parameters excluded).
        name: the layer's type name, e.g. ``"Linear"``.
    """

    forward: float
    backward: float
    param_bytes: int = 0
    activation_bytes: int = 0
    saved_bytes: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        for field in ("forward", "backward"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"LayerCost.{field}: expected seconds as a float, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"LayerCost.{field}: expected a finite value >= 0, got {value}")
        for field in ("param_bytes", "activation_bytes", "saved_bytes"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"LayerCost.{field}: expected an int >= 0, got {value!r}")

    @property
    def time(self) -> float:
        """Forward plus backward seconds."""
        return self.forward + self.backward
