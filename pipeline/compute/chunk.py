"""One model chunk on its device: forward, backward (full or split into I and W), recompute.

A chunk receives any pytree of tensors (see ``pipeline.payloads.tree``) and keeps,
per micro-batch, what its backward needs. Three things keep it exact on real
models:

- every run of its layers enters one context (``pipeline.compute.layer_run``): the
  layers get copies of every input that a write in place could harm unseen, so the
  user's ``x``, the sender's saved tensors and the input kept for recomputation stay
  intact; and every layer that draws random numbers does so under a seed of its own
  per micro-batch (``pipeline.compute.recompute``), the same in the recomputation,
  the others under the chunk's seed;
- a recomputation runs with the buffers and the layers' own generators as its
  forward found them (``forward_state``);
- a recomputation leaves BatchNorm's running statistics as they were
  (``pipeline.compute.batchnorm``), or none of the forwards touch them when the
  statistics are deferred to the end of the step.

A chunk whose schedule never splits its backward runs a plain one: ``split_backward``
is entered only once a step splits (or an I runs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from schedules.recompute import CheckpointMode, recomputed, recomputes
from split_backward import ChunkSplit, SplitMode, WeightGradients, check_mode

from pipeline.compute.activations import ActivationTracker
from pipeline.compute.batchnorm import DeferredStatistics, frozen_statistics, running_norms
from pipeline.compute.forward_state import ForwardState, Replay
from pipeline.compute.layer_run import LayerRun, LayerRuns, owned_copy
from pipeline.compute.loss import microbatch_loss
from pipeline.compute.tied_hooks import SharedGrads
from pipeline.errors import StageError
from pipeline.payloads.tree import Flat, detach, flatten

Grads = tuple[torch.Tensor | None, ...]


@dataclass
class _Stash:
    """What a micro-batch leaves behind between its forward and its backward."""

    inputs: Flat  # the chunk's inputs as fresh leaves (differentiable ones may require grad)
    # per input leaf that can carry a gradient: the leaf if it requires one, else None
    wanted: tuple[torch.Tensor | None, ...]
    target: Any = None
    weight: float = 1.0
    outputs: tuple[torch.Tensor, ...] | None = None  # the differentiable ones: the roots
    loss: torch.Tensor | None = None


@dataclass(frozen=True)
class ChunkSpec:
    """Where a chunk sits in the model and the step: for names, seeds and recomputation."""

    index: int
    stage: int
    first_layer: int
    is_first: bool
    is_last: bool


@dataclass(frozen=True)
class ChunkOptions:
    """How a chunk runs, the same for every chunk of a Pipe."""

    checkpoint: CheckpointMode
    loss_fn: Callable[..., Any] | None
    deferred_batch_norm: bool = False
    split_backward: SplitMode = "auto"  # how I and W split: see ``split_backward.chunk_split``

    def __post_init__(self) -> None:
        check_mode(self.split_backward)


class ChunkRunner:
    """Runs a contiguous slice of the model's layers, micro-batch by micro-batch.

    ``forward`` keeps what ``backward`` (or ``backward_input`` then
    ``backward_weight``) needs, according to the checkpoint mode. The gradients
    returned are those with respect to the differentiable input leaves, in order.
    ``sharded``: the runtime sharded the layers (FSDP2), whose hooks expect weight
    gradients in the backward, so a split takes the graph split.
    """

    def __init__(
        self,
        spec: ChunkSpec,
        layers: nn.Sequential,
        device: torch.device,
        options: ChunkOptions,
        tracker: ActivationTracker | None,
        rng_lock: threading.Lock | None,
        grad_lock: SharedGrads | None = None,
        sharded: bool = False,
    ) -> None:
        self.spec = spec
        self.layers = layers
        self.device = device
        self.options = options
        self._tracker = tracker
        self.rng_lock = rng_lock
        # Held around weight-gradient accumulation when a parameter is shared with another
        # chunk, whose stage may accumulate into the same ``.grad`` at the same moment
        # (``tied_hooks``: it also runs such a parameter's hooks once per micro-batch).
        self.grad_lock = grad_lock
        self._stash: dict[int, _Stash] = {}
        self._weights: dict[int, WeightGradients] = {}  # what each micro-batch's I left for W
        self.sharded = sharded
        self._split: ChunkSplit | None = None  # made by the first step that splits, or an I
        self._recomputed: tuple[bool, ...] = recomputed(options.checkpoint, 1)
        self._norms = running_norms(layers)
        self._state = ForwardState(layers)
        self._runs = LayerRuns(len(layers), device, spec.first_layer, self._state.generators)
        self._replays: dict[int, Replay] = {}  # per recomputed micro-batch
        self.deferred = DeferredStatistics(layers) if options.deferred_batch_norm else None

    @property
    def tracker(self) -> ActivationTracker | None:
        """The stage's tracker while a step is measured (``Pipe.measure_memory``), else None."""
        return self._tracker if self._tracker is not None and self._tracker.measuring else None

    def begin_step(self, seed_base: int, microbatches: int, splits: bool = False) -> None:
        """Forget the previous step's state and set this step's seeds and counts; ``splits``:
        the step splits some backward of this chunk into I and W, so its layers defer
        from the step's first forward on (not from its first I)."""
        self._stash.clear()
        self._weights.clear()
        self._replays.clear()
        if self._split is not None:
            self._split.begin_step()
        if splits:
            self._splitting().install()
        self._runs.begin_step(seed_base)
        if len(self._recomputed) != microbatches:
            self._recomputed = recomputed(self.options.checkpoint, microbatches)
        if self.deferred is not None:
            self.deferred.begin_step()

    def _splitting(self) -> ChunkSplit:
        """The chunk's split backward, made the first time a step needs it."""
        if self._split is None:
            self._split = ChunkSplit(self.layers, self.options.split_backward,
                                     sharded=self.sharded)
        return self._split

    def close(self) -> None:
        """Undo what running this chunk did to its layers (their switched forwards)."""
        if self._split is not None:
            self._split.uninstall()

    def end_step(self) -> None:
        """Commit deferred BatchNorm statistics (after a successful step)."""
        if self.deferred is not None:
            self.deferred.commit()

    # -- forward ----------------------------------------------------------------------------

    def _stashed(self, inputs: Any, target: Any, weight: float) -> _Stash:
        """The stash of a forward: its inputs as fresh leaves (those that can carry a
        gradient require one, except the caller's ``x`` unless it does)."""
        flat = flatten(inputs)
        differentiable = {id(leaf) for leaf in flat.differentiable}
        leaves: list[Any] = []
        wanted: list[torch.Tensor | None] = []
        for leaf in flat.leaves:
            if isinstance(leaf, torch.Tensor):
                can = id(leaf) in differentiable
                grad = can and (not self.spec.is_first or leaf.requires_grad)
                leaf = leaf.detach().requires_grad_(grad)  # fresh objects die with the stash
                if can:
                    wanted.append(leaf if grad else None)
            leaves.append(leaf)
        # No target (every chunk but the last): no pytree walk over None (see
        # ``layer_run.seeded`` for what the two cuts bought a forward).
        return _Stash(Flat(tuple(leaves), flat.spec), tuple(wanted),
                      None if target is None else detach(target), weight)

    def _run_layers(self, microbatch: int, inputs: Flat, owned: bool = False) -> Any:
        """The layers' output for ``inputs`` (``owned``: the chunk's own copies, which the
        layers may write)."""
        # With threads, the layers run holding their device's generator lock: no draw,
        # seeded or not, may take numbers meant for another stage's layer.
        with self.rng_lock if self.rng_lock is not None else nullcontext():
            with self._runs.exact(microbatch, inputs, owned) as run:
                value = self._call_layers(microbatch, run)
            if run.refused:
                # torch refused a write to an input before making it: run again on copies,
                # the layers' generators as this forward found them.
                with self._runs.exact(microbatch, inputs) as run:
                    value = self._call_layers(microbatch, run)
        return value

    def _call_layers(self, microbatch: int, run: LayerRun) -> Any:
        value = run.inputs
        offset = 0
        try:
            if run.quiet:  # the common case: plain calls, nothing per layer
                for offset, layer in enumerate(self.layers):
                    value = layer(value)
            else:
                for offset, layer in enumerate(self.layers):
                    value = run.layer(offset, layer, value)
        except Exception as error:
            name = type(self.layers[offset]).__name__
            raise StageError(
                f"stage {self.spec.stage}, layer {self.spec.first_layer + offset} ({name}), "
                f"micro-batch {microbatch}: {type(error).__name__}: {error}"
            ) from error
        return value

    def _statistics(self, first: bool) -> Any:
        """BatchNorm handling for a forward: the first one updates (or records), a rerun not."""
        if self.deferred is not None:
            return self.deferred.recording(record=first)
        return nullcontext() if first else frozen_statistics(self._norms)

    def _forward_with_graph(self, microbatch: int, stash: _Stash, first: bool) -> Any:
        """The layers' outputs, their graph kept for the backward (and the loss, last)."""
        key = (microbatch, self.spec.index)
        recording = self.tracker.recording(key) if self.tracker else nullcontext()
        if self.spec.is_first:
            # The caller's x (the stash holds views of it) must not be written: the layers get
            # copies, which replace the views in the stash.
            stash.inputs = owned_copy(stash.inputs)
        split = self._split
        with recording, self._statistics(first), \
                nullcontext() if split is None else split.forwarding(microbatch):
            outputs = self._run_layers(microbatch, stash.inputs, owned=self.spec.is_first)
            if self.spec.is_last:
                stash.loss = self._loss(microbatch, outputs, stash)
            else:
                stash.outputs = flatten(outputs).differentiable
        return outputs

    def _loss(self, microbatch: int, outputs: Any, stash: _Stash) -> torch.Tensor:
        return microbatch_loss(self.options.loss_fn, outputs, stash.target, stash.weight,
                               self.rng_lock, microbatch, self.spec.stage)

    def forward(self, microbatch: int, inputs: Any, target: Any = None, weight: float = 1.0) -> Any:
        """Run the chunk's forward for one micro-batch of a training step.

        Returns the detached outputs to send on, or, for the last chunk, the
        detached loss multiplied by the micro-batch's ``weight``.
        """
        stash = self._stash[microbatch] = self._stashed(inputs, target, weight)
        decided = self._recomputed  # a probe runs micro-batches past the step's count
        recomputed = decided[microbatch] if microbatch < len(decided) else recomputes(
            self.options.checkpoint, microbatch, len(decided))
        if self.tracker is not None and (recomputed or not self.spec.is_first):
            # The stash keeps the inputs until the backward, whether or not a layer saves
            # them (a view a layer saves too is counted once); the first chunk's are the
            # caller's batch, held anyway, unless a recomputation needs them.
            for tensor in stash.inputs.tensors:
                self.tracker.track((microbatch, self.spec.index), tensor)
        if not recomputed:
            outputs = self._forward_with_graph(microbatch, stash, first=True)
            if self.spec.is_last:
                assert stash.loss is not None
                return stash.loss.detach()
            return detach(outputs)
        before = self._state.before()
        with torch.no_grad(), self._statistics(first=True):
            outputs = self._run_layers(microbatch, stash.inputs)
            if self.spec.is_last:
                outputs = self._loss(microbatch, outputs, stash)
        self._replays[microbatch] = self._state.after(before)
        return detach(outputs)

    # -- backward ---------------------------------------------------------------------------

    def _ready_for_backward(self, microbatch: int) -> _Stash:
        stash = self._stash[microbatch]
        if stash.outputs is None and stash.loss is None:
            with self._state.replayed(self._replays.pop(microbatch, None)):
                self._forward_with_graph(microbatch, stash, first=False)
        return stash

    def _roots(
        self, stash: _Stash, grads: Grads | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        if self.spec.is_last:
            assert stash.loss is not None
            return [stash.loss], None
        assert stash.outputs is not None and grads is not None
        pairs = [
            (t, g) for t, g in zip(stash.outputs, grads)
            if t.requires_grad and g is not None
        ]
        return [t for t, _ in pairs], [g for _, g in pairs]

    @staticmethod
    def _input_grads(stash: _Stash, found: dict[int, torch.Tensor | None]) -> Grads:
        """One entry per differentiable input leaf: its gradient (zeros if unused)."""
        grads: list[torch.Tensor | None] = []
        for leaf in stash.wanted:
            if leaf is None:
                grads.append(None)
                continue
            grad = found.get(id(leaf))
            grads.append(torch.zeros_like(leaf) if grad is None else grad)
        return tuple(grads)

    def backward(self, microbatch: int, grads: Grads | None) -> Grads:
        """Full backward of one micro-batch: weight gradients accumulate into ``.grad``.

        Args:
            microbatch: which micro-batch.
            grads: gradients with respect to the chunk's differentiable output leaves
                (None for the last chunk, whose root is the loss).

        Returns:
            Gradients with respect to the chunk's differentiable input leaves (None for
            those that need none, such as the first chunk's unless ``x`` requires grad).
        """
        stash = self._ready_for_backward(microbatch)
        roots, root_grads = self._roots(stash, grads)
        wanted_inputs = [t for t in stash.wanted if t is not None]
        found: Grads = (None,) * len(wanted_inputs)
        if roots:
            backward = _plain_backward if self._split is None else self._split.backward
            with self._accumulating(microbatch):
                found = self._autograd(microbatch, "B", backward, roots, root_grads,
                                       wanted_inputs, microbatch)
        del self._stash[microbatch]
        return self._input_grads(stash, {id(t): g for t, g in zip(wanted_inputs, found)})

    def backward_input(self, microbatch: int, grads: Grads | None) -> Grads:
        """The I half of a split backward: input gradients now, weight gradients left for W.

        See ``split_backward``: Linear layers that defer their own weight gradients
        record what W needs, and the graph split covers the rest.
        """
        stash = self._ready_for_backward(microbatch)
        roots, root_grads = self._roots(stash, grads)
        wanted_inputs = [t for t in stash.wanted if t is not None]
        found: tuple[torch.Tensor | None, ...] = (None,) * len(wanted_inputs)
        if roots:
            with (nullcontext() if self.grad_lock is None
                  else self.grad_lock.accumulating_in_input(microbatch)):
                found, weights = self._autograd(
                    microbatch, "I", self._splitting().backward_input, roots,
                    root_grads or [None] * len(roots), wanted_inputs, microbatch,
                )
            self._weights[microbatch] = weights
            if self.tracker is not None:
                # One view a storage: a captured gradient reaches several junctions as views
                # of one tensor (a bias add and its product), which is one block of memory.
                storages = {t.untyped_storage().data_ptr(): t for t in weights.held()}
                for tensor in storages.values():
                    self.tracker.track((microbatch, self.spec.index), tensor)
        # The graph, the inputs and the outputs live on only where W needs them.
        del self._stash[microbatch]
        return self._input_grads(stash, {id(t): g for t, g in zip(wanted_inputs, found)})

    def backward_weight(self, microbatch: int) -> None:
        """The W half of a split backward: weight gradients accumulate into ``.grad``."""
        weights = self._weights.pop(microbatch, None)
        if weights is None:
            return
        with self._accumulating(microbatch):
            self._autograd(microbatch, "W", weights.run)

    def _accumulating(self, microbatch: int) -> AbstractContextManager[None]:
        return nullcontext() if self.grad_lock is None else self.grad_lock.accumulating(microbatch)

    def _autograd(self, microbatch: int, op: str, function: Callable[..., Any], *args: Any) -> Any:
        try:
            return function(*args)
        except Exception as error:
            raise StageError(
                f"stage {self.spec.stage}, chunk {self.spec.index} (layers from "
                f"{self.spec.first_layer}), micro-batch {microbatch}, {op}: "
                f"{type(error).__name__}: {error}"
            ) from error

    def infer(self, microbatch: int, inputs: Any) -> Any:
        """Forward for ``Pipe.__call__``: no stash, autograd graph kept if grad is enabled."""
        flat = flatten(inputs)
        with nullcontext() if self.deferred is None else self.deferred.recording(record=True):
            return self._run_layers(microbatch, flat)


def _plain_backward(roots: list[torch.Tensor], root_grads: list[torch.Tensor] | None,
                    inputs: list[torch.Tensor], microbatch: int) -> Grads:
    """A whole backward where nothing splits: weight gradients accumulate, and the
    gradients of ``inputs`` (leaves) are their ``.grad``."""
    torch.autograd.backward(roots, root_grads)
    return tuple(t.grad for t in inputs)
