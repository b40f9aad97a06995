"""What a model costs, as measured by ``profile``: per layer (LayerCost), its loss, and both."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def _check_seconds(owner: str, values: dict[str, float]) -> None:
    for field, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{owner}.{field}: expected seconds as a float, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{owner}.{field}: expected a finite value >= 0, got {value}")


@dataclass(frozen=True)
class LayerCost:
    """The measured cost of one layer, for one micro-batch.

    Attributes:
        forward: seconds of the forward pass.
        backward: seconds of the full backward pass (input and weight gradients at once).
        param_bytes: bytes of the layer's parameters; a parameter shared with an
            earlier layer (a tied head) is counted there, not here.
        activation_bytes: bytes of the layer's output, what a cut after it sends
            (also readable as ``output_bytes``).
        saved_bytes: bytes autograd keeps for the layer's backward (parameters excluded).
        name: the layer's type name, e.g. ``"Linear"``, or a traced unit's name, e.g.
            ``"model.layers.3"`` or ``"(prologue)"``.
        backward_input: seconds of the input-gradient half of a split backward (I):
            the gradient with respect to the layer's input only, graph kept. 0 when
            the input needs no gradient (the first layer, for a sample without grad).
        backward_weight: seconds of the weight-gradient half (W), from what I kept
            (``split_backward``). 0 for a layer without parameters.
        weight_bytes: bytes the layer keeps from its I to its W (the saved tensors
            its weight gradients read and the gradients I captured for them); None
            where its whole graph stays until W (a node without a weight rule, or no
            input gradient, as for a first layer whose input needs none).
        kept_input_bytes: bytes of its input the layer saves itself (None: not
            measured). A chunk keeps its input until its backward; where its first
            layer does not save it (a ReLU after the cut), the chunk holds it on top
            of the saved bytes.
        shared_input_bytes: the part of ``saved_bytes`` that is the layer's input which
            the layer before saves too, as its output (a Linear after a ReLU): in one
            chunk that tensor is kept once, so a chunk's saved bytes count it only
            where the chunk starts at this layer (``saved_bytes_of``).
        exchange: seconds of its forward spent on expert all-to-alls (part of ``forward``;
            its backward spends as long): what an overlapped pair can hide
            (``schedules.Costs.exchange``).
    """

    forward: float
    backward: float
    param_bytes: int = 0
    activation_bytes: int = 0
    saved_bytes: int = 0
    name: str = ""
    backward_input: float = 0.0
    backward_weight: float = 0.0
    shared_input_bytes: int = 0
    tied: tuple[tuple[int, int], ...] = ()
    weight_bytes: int | None = None
    kept_input_bytes: int | None = None
    exchange: float = 0.0

    def __post_init__(self) -> None:
        _check_seconds("LayerCost", {
            field: getattr(self, field)
            for field in ("forward", "backward", "backward_input", "backward_weight", "exchange")
        })
        for field in ("param_bytes", "activation_bytes", "saved_bytes", "shared_input_bytes"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"LayerCost.{field}: expected an int >= 0, got {value!r}")
        for field in ("weight_bytes", "kept_input_bytes"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 0):
                raise ValueError(f"LayerCost.{field}: expected an int >= 0 or None, got {value!r}")
        for entry in self.tied:
            if len(entry) != 2 or any(not isinstance(v, int) or isinstance(v, bool) or v < 0
                                      for v in entry):
                raise ValueError(f"LayerCost.tied: expected (layer, bytes) pairs of ints >= 0, "
                                 f"got {self.tied!r}")
        if self.shared_input_bytes > self.saved_bytes:
            raise ValueError(f"LayerCost.shared_input_bytes: expected at most saved_bytes "
                             f"({self.saved_bytes}), got {self.shared_input_bytes}")

    @property
    def time(self) -> float:
        """Forward plus backward seconds."""
        return self.forward + self.backward

    @property
    def output_bytes(self) -> int:
        """Bytes of the layer's output (the same number as ``activation_bytes``)."""
        return self.activation_bytes


@dataclass(frozen=True)
class LossCost:
    """The measured cost of the loss on the last layer's output, for one micro-batch.

    Attributes:
        forward: seconds of ``loss_fn(output, target)``.
        backward: seconds of its backward, down to the gradient of the output.
        saved_bytes: bytes autograd keeps for that backward (a cross-entropy's
            softmax), beyond what the last layer keeps already.
    """

    forward: float
    backward: float
    saved_bytes: int = 0

    def __post_init__(self) -> None:
        _check_seconds("LossCost", {"forward": self.forward, "backward": self.backward})
        if not isinstance(self.saved_bytes, int) or isinstance(self.saved_bytes, bool) \
                or self.saved_bytes < 0:
            raise ValueError(f"LossCost.saved_bytes: expected an int >= 0, "
                             f"got {self.saved_bytes!r}")

    @property
    def time(self) -> float:
        """Forward plus backward seconds."""
        return self.forward + self.backward


class Profile(list[LayerCost]):
    """What ``profile`` returns: a list of LayerCost, one per layer, and how it was measured.

    It is a plain list for everything that takes one (``balance``, ``report``,
    indexing, ``len``); the attributes say what the numbers are for.

    Attributes:
        loss: the loss's cost, if ``profile`` was given a ``loss_fn``; else None.
            ``balance(..., by="time")`` charges its time to the last stage.
        microbatch_size: rows (along dim 0) of the micro-batch measured; None for
            a sample without a batch dimension.
        device: where it was measured, e.g. ``"cpu"`` or ``"cuda:0"``.
    """

    def __init__(
        self,
        costs: Iterable[LayerCost],
        loss: LossCost | None = None,
        microbatch_size: int | None = None,
        device: str = "cpu",
    ) -> None:
        super().__init__(costs)
        self.loss = loss
        self.microbatch_size = microbatch_size
        self.device = device

    def __repr__(self) -> str:
        return (
            f"Profile({list.__repr__(self)}, loss={self.loss!r}, "
            f"microbatch_size={self.microbatch_size!r}, device={self.device!r})"
        )


def saved_bytes_of(layers: Sequence[LayerCost]) -> int:
    """Bytes autograd keeps for one micro-batch of these consecutive layers run as one
    chunk: each layer's ``saved_bytes``, a tensor two neighbours both save counted once."""
    return sum(cost.saved_bytes for cost in layers) - sum(
        cost.shared_input_bytes for cost in layers[1:])


def weight_bytes_of(layers: Sequence[LayerCost]) -> int:
    """Bytes a chunk of these layers keeps per micro-batch from its I to its W.

    I frees the graph as it goes only where every layer lets it; where one does not
    (``weight_bytes`` None), the whole chunk's graph stays until W.
    """
    if any(cost.weight_bytes is None for cost in layers):
        return saved_bytes_of(layers)
    return sum(cost.weight_bytes or 0 for cost in layers)


def check_ties(costs: Sequence[LayerCost]) -> None:
    """Raise ValueError unless every ``tied`` entry names an earlier layer and at most its
    parameter bytes (the shared parameters are part of that layer's)."""
    for layer, cost in enumerate(costs):
        for origin, nbytes in cost.tied:
            if origin >= layer:
                raise ValueError(f"LayerCost.tied of layer {layer}: expected an earlier layer, "
                                 f"got layer {origin}")
            if nbytes > costs[origin].param_bytes:
                raise ValueError(f"LayerCost.tied of layer {layer}: {nbytes} bytes of layer "
                                 f"{origin}, which has only {costs[origin].param_bytes} "
                                 f"parameter bytes")
