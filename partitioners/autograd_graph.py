"""Read the autograd graph behind a backward: the input chain and where parameters leave it.

A split backward computes input gradients first (I) and weight gradients later
(W). Which work belongs to which half is a property of the graph, not of the
layers: a node belongs to the *input chain* when some path from it reaches one
of the inputs whose gradient I returns; everything else reachable from the roots
(the weight side) only leads to parameters or other leaves. An edge from a chain
node to a weight-side node is an *exit*: the gradient that flows along it is all
that W needs from I. A chain node with exits is a *junction*; I captures the
gradient entering each junction (and whatever the junction itself computed for
its exits), W turns that into the exits' gradients and runs the weight side.

Reading the graph from the nodes rather than from layer boundaries is what
makes the split exact where layers are not the unit: a weight used twice in a
chunk, one module at several positions, outputs that repeat or derive from one
another, a loss with parameters of its own, a parameter whose path never meets
an input (its root is simply off the chain).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.autograd.graph import Node

Slot = tuple[Node, int]  # where a gradient enters a node: (node, input_nr)


@dataclass(frozen=True)
class Exit:
    """An edge leaving the input chain: output ``index`` of a junction feeds ``slot``."""

    index: int
    slot: Slot


@dataclass(frozen=True)
class Junction:
    """A node on the input chain with exits to the weight side."""

    node: Node
    exits: tuple[Exit, ...]


@dataclass(frozen=True)
class GraphSplit:
    """The chain/weight-side reading of one backward graph.

    Attributes:
        on_chain: per root, whether its node leads to an input (I differentiates it);
            a root off the chain is a weight-side root that W seeds directly.
        junctions: every chain node with exits, in no particular order.
    """

    on_chain: tuple[bool, ...]
    junctions: tuple[Junction, ...]


def split_graph(roots: Sequence[Node], inputs: Sequence[Node]) -> GraphSplit:
    """Walk the graph from ``roots`` and mark the input chain and its exits.

    Args:
        roots: the nodes the backward starts from (the outputs' gradient edges).
        inputs: the nodes of the inputs I differentiates (their gradient accumulators).

    Returns:
        The roots' places (on the chain or not) and the junctions.
    """
    targets = set(inputs)
    children: dict[Node, tuple[tuple[Node | None, int], ...]] = {}
    leads: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(root, False) for root in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            leads[node] = node in targets or any(
                child is not None and leads.get(child, False) for child, _ in children[node]
            )
            continue
        if node in children:
            continue
        edges = children[node] = tuple(node.next_functions)
        stack.append((node, True))
        stack.extend((child, False) for child, _ in edges if child is not None and child not in children)
    junctions = []
    for node, on_chain in leads.items():
        if not on_chain:
            continue
        exits = tuple(
            Exit(index, (child, input_nr))
            for index, (child, input_nr) in enumerate(children[node])
            if child is not None and not leads[child]
        )
        if exits:
            junctions.append(Junction(node, exits))
    return GraphSplit(tuple(leads[root] for root in roots), tuple(junctions))
