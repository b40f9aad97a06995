"""The split backward by the graph: I computes input gradients only, W weight gradients only.

``backward_input`` reads the graph (``split_backward.autograd_graph``) and runs one
engine call for the input gradients: the engine then computes nothing on the
weight side. The same call captures what W needs: for a junction (a node on the
input chain with edges to the weight side) that has a rule
(``split_backward.weight_rules``), the gradient entering it, read by a node
pre-hook; a junction without one is hooked, to record the gradient entering it
and whatever it computed for its exits itself (a custom ``autograd.Function`` or
a compiled region computes them anyway, so W never runs such a node twice). A
norm's exits are asked of the engine with the inputs (``weight_rules.FUSED``:
its kernel computes them with the input gradient at little more cost), so W only
accumulates them. It returns the input gradients and a ``WeightGradients``.

Tensor hooks (``h.register_hook``, ``weight.register_hook``) run once, on the
gradient a plain backward hands them. The engine runs a node's tensor hooks
when the node runs, but where it captures a gradient it names as an input it
runs them first only if the node does not run: a junction runs in I, so the
gradient it captured there missed the hooks on the layer's output (read after
them by a pre-hook instead), and a weight-side node does not, so its hooks ran at
the capture and again when W seeded it (a norm is fused only where its exits are
leaves without hooks; a junction without a rule is called again directly, not
through the engine).

``WeightGradients.run`` (W) turns each junction's captured gradient into its
exits' gradients (by its rule from the saved tensors, or by calling the
junction's backward again), then runs the weight side once, from all exits
together, through the engine's own accumulation: each parameter's
``AccumulateGrad`` runs once per W, so gradients accumulate as in a plain
backward and post-accumulate hooks fire. No input-side gradient is computed
twice, except by a junction without a rule (called outside the engine, a node
computes all its outputs), and every parameter reachable from the roots gets its
gradient, whether or not its path meets an input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.autograd.variable import Variable

from split_backward.autograd_graph import Exit, GraphSplit, Junction, Slot, recomputed_once, split_graph
from split_backward.first_stage import stops
from split_backward.records import Records, weight_root
from split_backward.weight_rules import Deferred, fused, prepare

Grads = tuple[torch.Tensor | None, ...]


def _engine(
    outputs: Sequence[torch.Tensor | GradientEdge],
    grads: Sequence[torch.Tensor],
    keep_graph: bool,
    inputs: Sequence[torch.Tensor | GradientEdge] = (),
    accumulate: bool = False,
) -> Grads:
    # The engine itself, as torch.autograd.grad/backward call it, without their Python
    # checks: gradients of a broadcast input are reduced to its shape by the engine, and
    # a W is several calls, each of which would pay those checks again.
    found = Variable._execution_engine.run_backward(
        tuple(outputs), tuple(grads), keep_graph, False, tuple(inputs), True, accumulate
    )
    return () if found is None else tuple(found)


class _Capture:
    """What one junction leaves for W: a rule prepared before I, what entered it during I."""

    __slots__ = ("junction", "deferred", "complete", "entered", "sent")

    def __init__(self, junction: Junction, deferred: Deferred | None,
                 complete: bool | None = None) -> None:
        self.junction = junction
        self.deferred = deferred  # the junction's rule, its saved tensors taken
        # A custom autograd.Function (a compiled region too) computes every output it
        # returns in I: what it leaves None is no gradient, as in a plain backward.
        self.complete = isinstance(junction.node, BackwardCFunction) if complete is None else complete
        self.entered: Grads | None = None  # the gradients that entered the node in I
        self.sent: dict[int, torch.Tensor] = {}  # exits the node computed itself

    def enter(self, grad_outputs: Grads) -> None:
        """A node pre-hook: the gradient entering the node, after its tensor hooks ran."""
        self.entered = grad_outputs

    def __call__(self, grad_inputs: Grads, grad_outputs: Grads) -> None:
        self.entered = grad_outputs
        for exit in self.junction.exits:
            grad = grad_inputs[exit.output]
            if grad is not None:
                self.sent[exit.output] = grad

    def exit_grads(self) -> list[tuple[Slot, torch.Tensor]]:
        """The gradients along the exits: computed in I, by the rule, or by the engine.

        Runs under ``torch.no_grad()``.
        """
        if self.entered is None:
            return []  # no gradient reached the junction
        exits = self.junction.exits
        grad = self.entered[0]
        if not self.sent and self.deferred is not None and grad is not None:
            # The common case: a rule, and the node computed none of its exits in I.
            computed = self.deferred.compute(grad)
            return [(exit.slot, computed[exit.output]) for exit in exits if exit.output in computed]
        found = [(exit.slot, self.sent[exit.output]) for exit in exits if exit.output in self.sent]
        missing = [exit for exit in exits if exit.output not in self.sent]
        if not missing or self.complete:
            return found
        if self.deferred is None:
            return found + _rerun(self.junction, self.entered, missing)
        if grad is None:
            return found
        computed = self.deferred.compute(grad)
        return found + [(exit.slot, computed[exit.output]) for exit in missing if exit.output in computed]


@dataclass
class WeightGradients:
    """What I leaves for W: the weight-side seeds known so far, the captured junctions, and
    what layers that defer their own weight gradients recorded (``deferred_linear``)."""

    seeds: list[tuple[Slot, torch.Tensor]]
    captures: list[_Capture]
    keeps_graph: bool = True  # False where I freed the graph as it went
    records: Records = field(default_factory=Records)

    @property
    def empty(self) -> bool:
        """Whether W has nothing to do (no parameter is reachable)."""
        return not self.seeds and not self.captures and not self.records

    def run(self) -> None:
        """Accumulate the weight gradients into ``.grad`` (W); the graph is freed as it goes.

        One engine call from every seed: a parameter the graph split and a deferring
        layer both reach accumulates once.
        """
        seeds = list(self.seeds)
        with torch.no_grad():
            for capture in self.captures:
                seeds.extend(capture.exit_grads())
        root = weight_root(self.records)
        self.seeds, self.captures, self.records = [], [], Records()
        roots: list[torch.Tensor | GradientEdge] = [GradientEdge(*slot) for slot, _ in seeds]
        grads = [g for _, g in seeds]
        if root is not None:
            roots.append(root)
            grads.append(torch.empty(0))
        if roots:
            # Through the seeds' own nodes (a Linear's weight.t(), say): a gradient the
            # engine makes is one AccumulateGrad may keep as .grad without a copy.
            _engine(roots, grads, keep_graph=False, accumulate=True)

    def held(self) -> list[torch.Tensor]:
        """The tensors kept for W: captured gradients and the saved tensors rules read."""
        tensors = [grad for _, grad in self.seeds]
        for record in self.records:
            tensors += [record.input, record.grad_output]
        for capture in self.captures:
            tensors.extend(g for g in capture.entered or () if g is not None)
            tensors.extend(capture.sent.values())
            if capture.deferred is not None:
                tensors.extend(capture.deferred.tensors)
        return tensors


def _rerun(junction: Junction, entered: Grads, missing: list[Exit]) -> list[tuple[Slot, torch.Tensor]]:
    """Run the junction's backward again, on what entered it in I, and keep its exits.

    Called as a function, not through the engine: ``entered`` already passed the node's
    tensor hooks, and the engine would run them again on it, then run the exits' own
    tensor hooks as it captured there, before W runs them once more.
    """
    backward = cast(Callable[..., Any], junction.node)  # torch's stubs give Node no __call__
    computed = backward(*entered)
    outputs = computed if isinstance(computed, tuple) else (computed,)
    return [(exit.slot, outputs[exit.output]) for exit in missing if outputs[exit.output] is not None]


def whole_backward(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                    inputs: Sequence[torch.Tensor]) -> Grads:
    """I as a whole backward, weight gradients included (W then has nothing to do).

    For a graph with a reentrant checkpoint, whose backward runs the engine again and
    refuses a call that names inputs: the inputs' gradients are read by hooks, and a
    leaf input's ``.grad`` is set as a plain backward sets it.
    """
    found: list[torch.Tensor | None] = [None] * len(inputs)

    def keep(index: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            found[index] = grad  # called once, with the tensor's whole gradient
        return hook

    # torch declares no types for Tensor.register_hook.
    handles = [tensor.register_hook(keep(index))  # type: ignore[no-untyped-call]
               for index, tensor in enumerate(inputs)]
    try:
        _engine(roots, grads, keep_graph=False, accumulate=True)
    finally:
        for handle in handles:
            handle.remove()
    return tuple(found)


def _unhooked_leaf(node: Node) -> bool:
    """Whether ``node`` accumulates a leaf that has no tensor hooks.

    The engine runs a node's tensor hooks as it captures there, in I, and again when W
    seeds it. A leaf shows its hooks (``_backward_hooks``); any other node hides them.
    """
    variable = getattr(node, "variable", None)  # AccumulateGrad's leaf
    return isinstance(variable, torch.Tensor) and not variable._backward_hooks


def _fusable(split: GraphSplit, junctions: Sequence[Junction]) -> list[Junction]:
    """The norms whose exits I may ask the engine for (``weight_rules.FUSED``).

    Asking for a slot makes the engine compute, in I, everything that flows into it:
    where anything but such norms feeds a norm's exit (its weight used again in the
    chunk, say), that share would be computed in I and again in W. Such a norm is
    deferred like any other junction, and so, in turn, may be a norm sharing its slots.
    So is a norm with an exit that is not a leaf without tensor hooks: the engine runs
    the hooks of a slot it captures, and W would run them again.
    """
    fusable = {junction.node for junction in junctions if fused(junction.node)
               and all(_unhooked_leaf(exit.slot[0]) for exit in junction.exits)}
    while True:
        shared = {junction.node for junction in junctions if junction.node in fusable
                  and any(parent not in fusable for exit in junction.exits
                          for parent in split.parents[exit.slot[0]])}
        if not shared:
            return [junction for junction in junctions if junction.node in fusable]
        fusable -= shared


def backward_input(
    roots: Sequence[torch.Tensor],
    root_grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
) -> tuple[Grads, WeightGradients]:
    """I: the gradients of ``roots`` with respect to ``inputs``, and what W needs.

    Args:
        roots: tensors to differentiate (each requires grad).
        root_grads: the gradient for each root; None means ones (a scalar loss).
        inputs: the tensors whose gradients I returns (each requires grad).

    Returns:
        One gradient per input (None where no path reaches it) and the pending
        weight gradients; the graph is kept until they run.
    """
    grads = [torch.ones_like(root) if g is None else g for root, g in zip(roots, root_grads)]
    root_edges = [get_gradient_edge(root) for root in roots]
    input_edges = [get_gradient_edge(leaf) for leaf in inputs]
    root_nodes = [edge.node for edge in root_edges]
    # No input to differentiate (a first stage): I runs down to the lowest products
    # (``split_backward.first_stage``), W does them and what lies below.
    stop_slots = [] if inputs else stops(root_nodes)
    split = split_graph(root_nodes, [edge.node for edge in input_edges]
                        or [node for node, _ in stop_slots])
    if split.reentrant:
        if inputs:
            return whole_backward(roots, grads, inputs), WeightGradients([], [])
        stop_slots = []  # it refuses an engine call that names inputs: W does everything
        split = split_graph(root_nodes, [])
    elif not any(split.on_chain) and inputs:  # no path reaches an input
        stop_slots = stops(root_nodes)
        if stop_slots:
            below = split_graph(root_nodes, [node for node, _ in stop_slots])
            split = split if below.reentrant else below
            stop_slots = [] if below.reentrant else stop_slots
    seeds = [((edge.node, edge.output_nr), g)
             for edge, g, on_chain in zip(root_edges, grads, split.on_chain) if not on_chain]
    chain = [(root, g) for root, g, on_chain in zip(roots, grads, split.on_chain) if on_chain]
    if not chain:
        return (None,) * len(inputs), WeightGradients(seeds, [])
    if any(recomputed_once(junction.node) for junction in split.junctions):
        # A selective checkpoint recomputes once: reading its tensors before I would be a
        # second recomputation (``autograd_graph.recomputed_once``).
        return whole_backward(roots, grads, inputs), WeightGradients([], [])
    stop_nodes = {node for node, _ in stop_slots}
    junctions = [junction for junction in split.junctions if junction.node not in stop_nodes]
    # A norm's exits are computed in I, with its input gradient (``weight_rules.FUSED``):
    # the engine returns what reaches each exit, and W only seeds it.
    norms = _fusable(split, junctions)
    fused_exits = list(dict.fromkeys(exit.slot for junction in norms for exit in junction.exits))
    captures = [
        _Capture(junction, prepare(junction.node, frozenset(exit.output for exit in junction.exits)))
        for junction in junctions if junction not in norms
    ]
    # A junction with a rule needs only the gradient entering it, and a node pre-hook sees
    # it after the node's tensor hooks (``h.register_hook`` on a layer's output): the
    # engine would capture it before them, since the node runs in I. The others are
    # hooked after the node, to see what they computed themselves.
    captured = [capture for capture in captures if capture.deferred is not None and not capture.complete]
    hooked = [capture for capture in captures if capture.deferred is None or capture.complete]
    # A stop does not run in I: the engine captures the gradient entering it (after its
    # tensor hooks), and W computes its outputs from that, by its rule or by calling it.
    stopped = {junction.node: _Capture(junction, prepare(
        junction.node, frozenset(exit.output for exit in junction.exits)), complete=False)
        for junction in split.junctions if junction.node in stop_nodes}
    # Where every junction has its rule (or computes its whole backward in I), W reads only
    # what I left: the engine may free each node's saved tensors as I passes it (and must,
    # for a compiled region that donates its buffers). A stop keeps its own: it never ran.
    keep_graph = any(capture.deferred is None and not capture.complete for capture in captures)
    handles = [capture.junction.node.register_prehook(capture.enter) for capture in captured]
    handles += [capture.junction.node.register_hook(capture) for capture in hooked]
    try:
        found = _engine([root for root, _ in chain], [g for _, g in chain], keep_graph=keep_graph,
                        inputs=[*input_edges, *(GradientEdge(*slot) for slot in fused_exits),
                                *(GradientEdge(*slot) for slot in stop_slots)])
    finally:
        for handle in handles:
            handle.remove()
    count, fused_count = len(input_edges), len(fused_exits)
    seeds += [(slot, grad) for slot, grad in zip(fused_exits, found[count:count + fused_count])
              if grad is not None]
    for (node, _), grad in zip(stop_slots, found[count + fused_count:]):
        # A leaf (a deferring layer's anchor) has nothing below it; a stop no gradient
        # reached has nothing to give.
        if node in stopped and grad is not None:
            stopped[node].entered = (grad,)
            captures.append(stopped[node])
    return found[:count], WeightGradients(seeds, captures, keep_graph)
