"""One model chunk on its device: forward, backward (full or split into I and W), recompute."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipeline.checkpoint import (
    CheckpointMode,
    is_stochastic,
    microbatch_seed,
    recomputes,
    seeded,
)
from pipeline.memory import ActivationTracker
from pipeline.microbatch import Tensors, as_tuple, from_tuple

Grads = tuple[torch.Tensor, ...]


class StageError(RuntimeError):
    """An exception raised inside a stage, with the stage, layer and micro-batch that raised it."""


@dataclass
class _Stash:
    """What a micro-batch leaves behind between its forward and its backward."""

    inputs: tuple[torch.Tensor, ...]
    target: Any = None
    weight: float = 1.0
    outputs: tuple[torch.Tensor, ...] | None = None
    loss: torch.Tensor | None = None
    layer_outputs: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    output_grads: list[Grads | None] = field(default_factory=list)


@dataclass(frozen=True)
class ChunkSpec:
    """Where a chunk sits in the model and the step: for names, seeds and recomputation."""

    index: int
    stage: int
    first_layer: int
    is_first: bool
    is_last: bool


class ModelChunk:
    """A contiguous slice of the model's layers, run micro-batch by micro-batch.

    ``forward`` keeps what ``backward`` (or ``backward_input`` then
    ``backward_weight``) needs, according to the checkpoint mode. Inputs arrive
    detached; the gradients returned are those with respect to the floating-point
    inputs, in order.
    """

    def __init__(
        self,
        spec: ChunkSpec,
        layers: nn.Sequential,
        device: torch.device,
        checkpoint: CheckpointMode,
        loss_fn: Callable[..., torch.Tensor] | None,
        tracker: ActivationTracker | None,
        rng_lock: threading.Lock | None,
    ) -> None:
        self.spec = spec
        self.layers = layers
        self.device = device
        self.checkpoint = checkpoint
        self.loss_fn = loss_fn
        self.tracker = tracker
        self.rng_lock = rng_lock
        self.stochastic = False
        self._stash: dict[int, _Stash] = {}
        self._seed_base = 0
        self._microbatches = 1
        self._split = False

    def begin_step(self, seed_base: int, microbatches: int, split_backward: bool) -> None:
        """Forget the previous step's state and set this step's seeds and counts."""
        self._stash.clear()
        self.stochastic = is_stochastic(self.layers)
        self._seed_base = seed_base
        self._microbatches = microbatches
        self._split = split_backward

    def _seed(self, microbatch: int) -> int | None:
        if not self.stochastic:
            return None
        return microbatch_seed(self._seed_base, self.spec.index, microbatch)

    def _run_layers(
        self, microbatch: int, inputs: tuple[torch.Tensor, ...], is_tuple: bool, record: bool
    ) -> tuple[tuple[torch.Tensor, ...], list[tuple[torch.Tensor, ...]]]:
        value: Any = from_tuple(inputs, is_tuple)
        recorded = []
        for offset, layer in enumerate(self.layers):
            try:
                value = layer(value)
            except Exception as error:
                name = type(layer).__name__
                raise StageError(
                    f"stage {self.spec.stage}, layer {self.spec.first_layer + offset} ({name}), "
                    f"micro-batch {microbatch}: {type(error).__name__}: {error}"
                ) from error
            if record:
                recorded.append(as_tuple(value))
        return as_tuple(value), recorded

    def _forward_with_graph(self, microbatch: int, stash: _Stash, is_tuple: bool) -> None:
        key = (microbatch, self.spec.index)
        recording = self.tracker.recording(key) if self.tracker else _nothing()
        with recording, seeded(self.device, self._seed(microbatch), self.rng_lock):
            outputs, layer_outputs = self._run_layers(
                microbatch, stash.inputs, is_tuple, record=self._split
            )
            stash.outputs = outputs
            stash.layer_outputs = layer_outputs
            if self.spec.is_last:
                stash.loss = self._loss(microbatch, outputs, stash)

    def _loss(self, microbatch: int, outputs: tuple[torch.Tensor, ...], stash: _Stash) -> torch.Tensor:
        if self.loss_fn is None:
            raise ValueError("step() needs a loss_fn: pass Pipe(..., loss_fn=nn.MSELoss()) or similar")
        output: Any = outputs[0] if len(outputs) == 1 else outputs
        try:
            loss = self.loss_fn(output, stash.target)
        except Exception as error:
            raise StageError(
                f"stage {self.spec.stage}, loss_fn, micro-batch {microbatch}: "
                f"{type(error).__name__}: {error}"
            ) from error
        if loss.dim() != 0:
            raise ValueError(f"loss_fn must return a scalar, got a tensor of shape {tuple(loss.shape)}")
        return loss * stash.weight

    def forward(
        self,
        microbatch: int,
        inputs: Tensors,
        target: Any = None,
        weight: float = 1.0,
    ) -> Tensors | torch.Tensor:
        """Run the chunk's forward for one micro-batch of a training step.

        Returns the detached outputs to send on, or, for the last chunk, the
        detached loss weighted by the micro-batch's share of the batch.
        """
        is_tuple = isinstance(inputs, tuple)
        detached = tuple(
            t.detach().requires_grad_(not self.spec.is_first and t.is_floating_point())
            for t in as_tuple(inputs)
        )
        # Fresh tensor objects, so what autograd saves dies with this micro-batch's stash.
        stash = _Stash(inputs=detached, target=_detach_any(target), weight=weight)
        stash.is_tuple = is_tuple  # type: ignore[attr-defined]
        self._stash[microbatch] = stash
        if recomputes(self.checkpoint, microbatch, self._microbatches):
            if self.tracker is not None:
                for tensor in detached:
                    self.tracker.track((microbatch, self.spec.index), tensor)
            with torch.no_grad(), seeded(self.device, self._seed(microbatch), self.rng_lock):
                outputs, _ = self._run_layers(microbatch, detached, is_tuple, record=False)
                if self.spec.is_last:
                    return self._loss(microbatch, outputs, stash).detach()
            return _detach_outputs(outputs)
        self._forward_with_graph(microbatch, stash, is_tuple)
        if self.spec.is_last:
            assert stash.loss is not None
            return stash.loss.detach()
        assert stash.outputs is not None
        return _detach_outputs(stash.outputs)

    def _ready_for_backward(self, microbatch: int) -> _Stash:
        stash = self._stash[microbatch]
        if stash.outputs is None and stash.loss is None:
            self._forward_with_graph(microbatch, stash, stash.is_tuple)  # type: ignore[attr-defined]
        return stash

    def _roots(
        self, stash: _Stash, grads: Grads | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        if self.spec.is_last:
            assert stash.loss is not None
            return [stash.loss], None
        assert stash.outputs is not None and grads is not None
        differentiable = [t for t in stash.outputs if t.is_floating_point()]
        pairs = [(t, g) for t, g in zip(differentiable, grads) if t.requires_grad]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _input_grads(self, stash: _Stash, found: tuple[torch.Tensor | None, ...]) -> Grads:
        floating = [t for t in stash.inputs if t.is_floating_point()]
        return tuple(g if g is not None else torch.zeros_like(t) for t, g in zip(floating, found))

    def backward(self, microbatch: int, grads: Grads | None) -> Grads:
        """Full backward of one micro-batch: weight gradients accumulate into ``.grad``.

        Args:
            microbatch: which micro-batch.
            grads: gradients with respect to the chunk's floating outputs (None for
                the last chunk, whose root is the loss).

        Returns:
            Gradients with respect to the chunk's floating inputs (empty for the first chunk).
        """
        stash = self._ready_for_backward(microbatch)
        roots, root_grads = self._roots(stash, grads)
        if roots:
            self._autograd(microbatch, "B", torch.autograd.backward, roots, root_grads)
        del self._stash[microbatch]
        if self.spec.is_first:
            return ()
        return self._input_grads(stash, tuple(t.grad for t in stash.inputs if t.is_floating_point()))

    def backward_input(self, microbatch: int, grads: Grads | None) -> Grads:
        """The I half of a split backward: input gradients now, weight gradients left for W."""
        stash = self._ready_for_backward(microbatch)
        roots, root_grads = self._roots(stash, grads)
        wanted_inputs = [] if self.spec.is_first else [
            t for t in stash.inputs if t.is_floating_point()
        ]
        boundaries = [
            [t for t in layer_output if t.requires_grad] for layer_output in stash.layer_outputs[:-1]
        ]
        targets = wanted_inputs + [t for boundary in boundaries for t in boundary]
        found: tuple[torch.Tensor | None, ...] = ()
        if roots and targets:
            found = self._autograd(
                microbatch, "I", _grad_keeping_graph, roots, root_grads, targets
            )
        else:
            found = (None,) * len(targets)
        position = len(wanted_inputs)
        stash.output_grads = []
        for boundary in boundaries:
            stash.output_grads.append(tuple(found[position : position + len(boundary)]))  # type: ignore[arg-type]
            position += len(boundary)
        stash.output_grads.append(None if self.spec.is_last else tuple(root_grads or ()))
        stash.root_count = len(roots)  # type: ignore[attr-defined]
        return () if self.spec.is_first else self._input_grads(stash, found[: len(wanted_inputs)])

    def backward_weight(self, microbatch: int) -> None:
        """The W half of a split backward: accumulate each layer's weight gradients."""
        stash = self._stash.pop(microbatch)
        for offset, (layer, layer_output) in enumerate(zip(self.layers, stash.layer_outputs)):
            parameters = [p for p in layer.parameters() if p.requires_grad]
            if not parameters:
                continue
            is_final = offset == len(self.layers) - 1
            if is_final and self.spec.is_last:
                roots, root_grads = [stash.loss], None
            else:
                outputs = [t for t in layer_output if t.requires_grad]
                grads = stash.output_grads[offset]
                pairs = [(t, g) for t, g in zip(outputs, grads or ()) if g is not None]
                roots, root_grads = [t for t, _ in pairs], [g for _, g in pairs]
            if not roots:
                continue
            found = self._autograd(
                microbatch, "W", _grad_of, roots, root_grads, parameters, offset
            )
            for parameter, grad in zip(parameters, found):
                if grad is None:
                    continue
                if parameter.grad is None:
                    parameter.grad = grad.detach().clone()
                else:
                    parameter.grad.add_(grad)

    def _autograd(self, microbatch: int, op: str, function: Callable[..., Any], *args: Any) -> Any:
        try:
            return function(*args)
        except Exception as error:
            raise StageError(
                f"stage {self.spec.stage}, chunk {self.spec.index} (layers from "
                f"{self.spec.first_layer}), micro-batch {microbatch}, {op}: "
                f"{type(error).__name__}: {error}"
            ) from error

    def infer(self, microbatch: int, inputs: Tensors) -> Tensors:
        """Forward for ``Pipe.__call__``: no stash, autograd graph kept if grad is enabled."""
        is_tuple = isinstance(inputs, tuple)
        with seeded(self.device, self._seed(microbatch), self.rng_lock):
            outputs, _ = self._run_layers(microbatch, as_tuple(inputs), is_tuple, record=False)
        return outputs[0] if len(outputs) == 1 else outputs


def _detach_any(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detach_any(v) for v in value)
    return value


def _detach_outputs(outputs: tuple[torch.Tensor, ...]) -> Tensors:
    detached = tuple(t.detach() for t in outputs)
    return detached[0] if len(detached) == 1 else detached


def _grad_keeping_graph(
    roots: list[torch.Tensor], root_grads: list[torch.Tensor] | None, targets: list[torch.Tensor]
) -> tuple[torch.Tensor | None, ...]:
    return torch.autograd.grad(
        roots, targets, root_grads, retain_graph=True, allow_unused=True
    )


def _grad_of(
    roots: list[torch.Tensor],
    root_grads: list[torch.Tensor] | None,
    parameters: list[torch.Tensor],
    _offset: int,
) -> tuple[torch.Tensor | None, ...]:
    # Each layer's subgraph is walked once, so its saved tensors can be freed as we go.
    return torch.autograd.grad(roots, parameters, root_grads, retain_graph=False, allow_unused=True)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
