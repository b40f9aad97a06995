"""Where a backward with no input to differentiate stops its I: the graph's lowest products.

A first stage's input needs no gradient, so the graph split has no input chain:
every node leads only to parameters, and I would be empty, W the whole backward.
Yet the work splits as it does on any other stage: the backward through the layers
(the gradients each layer passes down) belongs to I, the weight products to W.
What a first stage does not need is the gradient below its lowest layer. So I runs
down to the *stops*, the lowest nodes that compute a weight's share of a layer:

- a node with a weight rule (``weight_rules.RULES``: a product, a convolution, a
  norm, an add or multiply) that has no other such node below it;
- below a layer that defers its own weight gradient (``deferred_linear``, a traced
  addmm's too, ``deferred_conv``), the node its input gradient goes to (its anchor when
  the input needs none): such a layer must run in I, where its record is taken.

I captures the gradient entering each stop; W turns it into the stop's outputs (by
its rule, else by calling the node once) and runs the rest below. The stops are
never ancestors of one another, so no node runs in both I and W. A custom
``autograd.Function`` (a compiled region too) or a node of several outputs right
below a deferring layer is passed through (its children looked at instead): it
then runs whole in I, as a junction does elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import Node

from split_backward.autograd_graph import Slot
from split_backward.deferred_conv import DeferredConvolution
from split_backward.deferred_linear import DeferredLinear
from split_backward.weight_rules import RULES

_DEFERRING = (DeferredLinear, DeferredConvolution)  # a traced addmm is a DeferredLinear too


def _deferring(node: Node) -> bool:
    return isinstance(node, BackwardCFunction) and getattr(node, "_forward_cls", None) in _DEFERRING


def _below_deferring(node: Node) -> list[Node]:
    """The nodes a deferring layer's input gradient reaches, through custom Functions and
    nodes of several outputs (a stop has one: its captured gradient is all it receives)."""
    found, stack, seen = [], [child for child, _ in node.next_functions if child is not None], set()
    while stack:
        child = stack.pop()
        if child in seen:
            continue
        seen.add(child)
        if _deferring(child) or isinstance(child, BackwardCFunction) \
                or len(child._input_metadata) != 1:
            stack.extend(grandchild for grandchild, _ in child.next_functions if grandchild is not None)
        else:
            found.append(child)
    return found


def stops(roots: Sequence[Node]) -> list[Slot]:
    """The slots at which I stops, for a backward from ``roots`` with no input (see the
    module); empty where the graph has no such node (W then runs the whole backward)."""
    order: list[Node] = []  # children before parents
    candidates: set[Node] = set()
    seen: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(root, False) for root in roots]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        if node.name() in RULES:
            candidates.add(node)
        elif _deferring(node):
            candidates.update(_below_deferring(node))
        stack.append((node, True))
        stack.extend((child, False) for child, _ in node.next_functions
                     if child is not None and child not in seen)
    # A candidate with another candidate below it is not a stop: it runs in I.
    below: dict[Node, bool] = {}
    for node in order:
        below[node] = any(child in candidates or below.get(child, False)
                          for child, _ in node.next_functions if child is not None)
    return [(node, 0) for node in order if node in candidates and not below[node]]
