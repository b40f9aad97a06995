"""One chunk's split backward: layers defer their own weight gradients, the graph split does the rest.

Per chunk, the first I switches its Linear, MultiheadAttention and convolution
layers on (``install``, ``switched_layers``): from then on, while the chunk runs a
forward with a graph, each of their products whose weight gradient is worth moving
(``"auto"``: a linear one of at least ``MIN_PRODUCT`` estimated multiply-adds, or
every linear one in a chunk that has none so large; ``"layers"``: every one,
convolutions included) runs ``deferred_linear`` or
``deferred_conv``. A micro-batch whose
forward deferred something has an I that is one plain engine call (weight
gradients of everything else included: norms, embeddings, small layers) and a W
that is the recorded products. Everything the layers do not cover goes through the
exact graph split (``split_backward.graph_split``), chosen per micro-batch:

- a forward that deferred nothing (before the first I, a chunk without such
  layers, ``"graph"``);
- a graph in which a deferred parameter is also used otherwise (a tied head read
  by an embedding in the same chunk, ``x @ linear.weight.t()``): a plain I would
  accumulate that other use's share in I and W would accumulate again, so hooks
  would fire twice. The graph split leaves that share for W, and the recorded
  products join it there, in the one engine call. The graph is read once per set
  of deferred parameters, on the first micro-batch that shows it.

Which products can defer: those of an ``nn.Linear``, ``nn.MultiheadAttention`` or
``nn.Conv{1,2,3}d`` whose class keeps its own forward, without parametrizations,
whose weight (and bias) is a leaf of plain ``Parameter`` type (not set by a hook, not a
slice) or a tensor-parallel DTensor parameter's shard as a traced unit reads it, outside a ``torch.compile``d module and in a chunk the
runtime did not shard (``sharded``: FSDP's hooks expect weight gradients in the
backward): everything else stays as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Literal, TypeVar, get_args

import torch
from torch import nn
from torch.autograd.graph import Node, get_gradient_edge

from split_backward.records import Record, Records
from split_backward.graph_split import (
    Grads,
    WeightGradients,
    backward_input,
    whole_backward,
)
from split_backward.switched_layers import ACTIVE, switch_off, switch_on, switched

SplitMode = Literal["auto", "layers", "graph"]
SPLIT_MODES: tuple[str, ...] = get_args(SplitMode)

# Below this many multiply-adds, a layer's weight gradient costs less than deferring it
# (a custom Function in the forward, a Python backward, a record): it stays native.
MIN_PRODUCT = 2**18

_T = TypeVar("_T")


def _plain_leaf(tensor: torch.Tensor | None) -> bool:
    return tensor is None or (type(tensor) is nn.Parameter and tensor.grad_fn is None) \
        or _shard_of_parameter(tensor)


def _shard_of_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a tensor-parallel parameter's shard as a traced unit reads it
    (``to_local`` of a leaf DTensor): its gradient reaches the parameter through that one
    node, so W accumulates it there as into a plain leaf."""
    node = tensor.grad_fn
    if node is None or type(tensor) is not torch.Tensor \
            or type(node).__name__ != "_ToTorchTensorBackward":
        return False
    following = node.next_functions
    return len(following) == 1 and type(following[0][0]).__name__ == "AccumulateGrad"


def check_mode(mode: object) -> SplitMode:
    """``mode`` if it names a split, else a ValueError naming the choices."""
    if mode == "auto" or mode == "layers" or mode == "graph":
        return mode
    raise ValueError(f"split_backward must be one of {', '.join(map(repr, SPLIT_MODES))}, "
                     f"got {mode!r}")


class ChunkSplit:
    """The split backward of one chunk's layers, chosen per micro-batch (see the module).

    ``sharded``: the runtime sharded the layers (FSDP2), so none defers its own weight
    gradient and the graph split takes them all.
    """

    def __init__(self, layers: nn.Module, mode: SplitMode = "auto", sharded: bool = False
                 ) -> None:
        self.mode = check_mode(mode)
        self.sharded = sharded
        self.records = Records()  # what the deferred calls recorded in the running backward
        self._layers = layers
        self._installed = False
        self._before: frozenset[int] = frozenset()  # layers switched before install (kept)
        self._microbatch = 0
        # micro-batch -> ids of the parameters its forward deferred (a key only where the
        # forward ran with the layers switched on)
        self._deferred: dict[int, set[int]] = {}
        self._whole: dict[frozenset[int], bool] = {}  # deferred parameters -> I may be plain
        self._large_seen = False  # "auto": a product of MIN_PRODUCT or more ran in a forward

    @property
    def installed(self) -> bool:
        """Whether the chunk's Linear layers are switched on."""
        return self._installed

    def install(self) -> None:
        """Switch the chunk's deferrable layers on (once; ``"graph"``: never)."""
        if self._installed or self.mode == "graph":
            return
        self._installed = True
        if self.sharded:
            return  # FSDP's hooks expect weight gradients in the backward: the graph split
        self._before = frozenset(id(m) for m in self._layers.modules() if switched(m))
        switch_on(self._layers)

    def uninstall(self) -> None:
        """Take the switched forwards off the layers this split switched on (those switched
        before it stay): the user's modules are as they were."""
        if self._installed:
            switch_off(self._layers, keep=self._before)
            self._installed = False

    def begin_step(self) -> None:
        """Forget what the previous step's forwards deferred."""
        self._deferred.clear()
        self.records = Records()

    def record(self, record: Record) -> None:
        """Called by a deferred layer's backward: its share of W (``deferred_linear``)."""
        self.records.append(record)

    def defers(self, weight: torch.Tensor | None, bias: torch.Tensor | None,
               multiply_adds: int, convolution: bool = False) -> bool:
        """Whether a layer's call defers its weight gradient, of about ``multiply_adds``
        (and note it if so): both parameters plain leaves, the product big enough and not
        a convolution's (``"auto"``)."""
        if weight is None or not weight.requires_grad or not _plain_leaf(weight) \
                or not _plain_leaf(bias):
            return False
        if self.mode == "auto":
            if convolution:
                # A convolution deferred by its layer measured no faster than by the graph
                # split (ResNet stage (I+W)/B 1.16-1.19 against 1.12-1.16, one process).
                return False
            if multiply_adds >= MIN_PRODUCT:
                self._large_seen = True
            elif self._large_seen:
                # Small products keep their weight gradients in a plain I beside the large
                # ones. In a chunk of small ones alone, the graph split would take them all:
                # deferred they cost less (8 x Linear(16): (I+W)/B 1.6 against 2.5).
                return False
        deferred = self._deferred.setdefault(self._microbatch, set())
        deferred.add(id(weight))
        if bias is not None:
            deferred.add(id(bias))
        return True

    @contextmanager
    def _switched_on(self, microbatch: int) -> Iterator[None]:
        self._microbatch = microbatch
        token = ACTIVE.set(self)
        try:
            yield
        finally:
            ACTIVE.reset(token)

    @contextmanager
    def forwarding(self, microbatch: int) -> Iterator[None]:
        """Around a forward that keeps its graph for a backward of this chunk."""
        if not self._installed:
            yield
            return
        self._deferred.setdefault(microbatch, set())
        with self._switched_on(microbatch):
            yield

    def _backward(self, microbatch: int, run: Callable[[], _T]) -> tuple[_T, Records]:
        # The layers are on in the backward exactly where they were in the forward: a
        # non-reentrant checkpoint's recomputation must save what the forward saved.
        on = microbatch in self._deferred
        self.records = Records()
        with self._switched_on(microbatch) if on else nullcontext():
            found = run()
        self._deferred.pop(microbatch, None)
        records, self.records = self.records, Records()
        return found, records

    def backward(self, roots: Sequence[torch.Tensor], root_grads: Sequence[torch.Tensor] | None,
                 inputs: Sequence[torch.Tensor], microbatch: int) -> Grads:
        """A whole backward (B): weight gradients accumulate, the recorded products too.

        Returns the gradients of ``inputs`` (leaves: their ``.grad``).
        """
        deferred = frozenset(self._deferred.get(microbatch, ()))
        if deferred and not self._plain(deferred, roots):
            # A deferred parameter used otherwise too: as an I then its W, so that it
            # accumulates once.
            seeds: list[torch.Tensor | None] = [None] * len(roots) if root_grads is None \
                else list(root_grads)
            found, weights = self.backward_input(roots, seeds, inputs, microbatch)
            weights.run()
            return found
        grads = None if root_grads is None else list(root_grads)
        _, records = self._backward(microbatch, lambda: torch.autograd.backward(list(roots), grads))
        if records:
            WeightGradients([], [], records=records).run()
        return tuple(t.grad for t in inputs)

    def backward_input(self, roots: Sequence[torch.Tensor],
                       root_grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor],
                       microbatch: int) -> tuple[Grads, WeightGradients]:
        """I: the inputs' gradients, and what W needs (switches the layers on for later forwards)."""
        self.install()
        deferred = frozenset(self._deferred.get(microbatch, ()))

        def run() -> tuple[Grads, WeightGradients]:
            if deferred and self._plain(deferred, roots):
                grads = [torch.ones_like(r) if g is None else g for r, g in zip(roots, root_grads)]
                return whole_backward(roots, grads, inputs), WeightGradients([], [], keeps_graph=False)
            return backward_input(roots, root_grads, inputs)

        (found, weights), records = self._backward(microbatch, run)
        weights.records = records
        return found, weights

    def _plain(self, deferred: frozenset[int], roots: Sequence[torch.Tensor]) -> bool:
        """Whether no deferred parameter is reached in the graph but through its layer."""
        known = self._whole.get(deferred)
        if known is None:
            known = self._whole[deferred] = not any(
                id(getattr(node, "variable", None)) in deferred
                for node in _nodes(get_gradient_edge(root).node for root in roots))
        return known


@contextmanager
def trial_split(layers: nn.Module, mode: SplitMode = "auto") -> Iterator[ChunkSplit]:
    """A ``ChunkSplit`` of ``layers``, switched on, to time or size I and W as a chunk runs
    them (``partitioners``' profile); afterwards the layers it switched are as they were."""
    before = frozenset(id(module) for module in layers.modules() if switched(module))
    split = ChunkSplit(layers, mode)
    split.install()
    try:
        yield split
    finally:
        switch_off(layers, keep=before)


def _nodes(roots: Iterator[Node]) -> Iterator[Node]:
    seen: set[Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(child for child, _ in node.next_functions if child is not None)
