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
from contextlib import nullcontext
from typing import NamedTuple

from torch.autograd.graph import Node
from torch.utils.checkpoint import CheckpointFunction

_REENTRANT = CheckpointFunction._backward_cls

Slot = tuple[Node, int]  # where a gradient enters a node: (node, input_nr)


class Exit(NamedTuple):
    """An edge leaving the input chain: the junction's gradient ``output`` feeds ``slot``."""

    output: int
    slot: Slot


class Junction(NamedTuple):
    """A node on the input chain with exits to the weight side."""

    node: Node
    exits: tuple[Exit, ...]


class GraphSplit(NamedTuple):
    """The chain/weight-side reading of one backward graph.

    Attributes:
        on_chain: per root, whether its node leads to an input (I differentiates it);
            a root off the chain is a weight-side root that W seeds directly.
        junctions: every chain node with exits, in no particular order.
        parents: every node's parents (the nodes with an edge to it).
        reentrant: whether a chain node runs a backward of its own inside the engine
            (``torch.utils.checkpoint`` with ``use_reentrant=True``): its parameters are
            not in this graph, and it refuses an engine call that names inputs.
    """

    on_chain: tuple[bool, ...]
    junctions: tuple[Junction, ...]
    parents: dict[Node, list[Node]]
    reentrant: bool


def split_graph(roots: Sequence[Node], inputs: Sequence[Node]) -> GraphSplit:
    """Walk the graph from ``roots`` and mark the input chain and its exits.

    Args:
        roots: the nodes the backward starts from (the outputs' gradient edges).
        inputs: the nodes of the inputs I differentiates (their gradient accumulators).

    Returns:
        The roots' places (on the chain or not) and the junctions.
    """
    # Once down from the roots to find every node and its parents, then up from the
    # inputs: the chain is every node an input is reachable from. Two flat loops, as
    # this runs before every I.
    children: dict[Node, tuple[tuple[Node | None, int], ...]] = {}
    parents: dict[Node, list[Node]] = {}
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in children:
            continue
        edges = children[node] = node.next_functions
        for child, _ in edges:
            if child is not None:
                parents.setdefault(child, []).append(node)
                if child not in children:
                    stack.append(child)
    chain = {node for node in inputs if node in children}
    rising = list(chain)
    while rising:
        for parent in parents.get(rising.pop(), ()):
            if parent not in chain:
                chain.add(parent)
                rising.append(parent)
    junctions = []
    for node in chain:
        exits = tuple(
            Exit(index, (child, input_nr))
            for index, (child, input_nr) in enumerate(children[node])
            if child is not None and child not in chain
        )
        if exits:
            junctions.append(Junction(node, exits))
    reentrant = any(isinstance(node, _REENTRANT) for node in chain)
    return GraphSplit(tuple(root in chain for root in roots), tuple(junctions), parents, reentrant)


_SAVED: dict[type, tuple[str, ...]] = {}  # a node class -> the names of its raw saved tensors


def recomputed_once(node: Node) -> bool:
    """Whether a tensor ``node`` saved is recomputed by a checkpoint that refuses a second
    recomputation: a non-reentrant ``torch.utils.checkpoint`` with a ``context_fn``
    (selective activation checkpointing replays what its policy kept once, then raises).

    The graph split reads a rule's saved tensors before I (a recomputation of its own),
    then the engine unpacks them in I (another): such a graph takes a whole backward in I.
    Reads torch's internals: a checkpoint's unpack hook closes over its
    ``_CheckpointFrame``, whose ``recompute_fn`` closes over ``recompute_context``
    (a ``nullcontext`` without a ``context_fn``). Were torch to change that, this
    returns False and a selective checkpoint fails with torch's own error in I, never
    silently.
    """
    names = _SAVED.get(type(node))
    if names is None:
        names = _SAVED[type(node)] = tuple(name for name in dir(node) if name.startswith("_raw_saved_"))
    for name in names:
        try:
            saved = getattr(node, name)
        except RuntimeError:  # freed
            continue
        for one in saved if isinstance(saved, (list, tuple)) else (saved,):
            if _selective(getattr(one, "unpack_hook", None)):
                return True
    return False


def _selective(hook: object) -> bool:
    if hook is None or getattr(hook, "__qualname__", "") != "_checkpoint_hook.__init__.<locals>.unpack_hook":
        return False
    for cell in getattr(hook, "__closure__", None) or ():
        recompute = getattr(_contents(cell), "recompute_fn", None)
        code = getattr(recompute, "__code__", None)
        if recompute is None or code is None:
            continue
        for name, inner in zip(code.co_freevars, recompute.__closure__ or ()):
            if name == "recompute_context" and not isinstance(_contents(inner), nullcontext):
                return True
    return False


def _contents(cell: object) -> object:
    try:
        return cell.cell_contents  # type: ignore[attr-defined]
    except ValueError:  # an empty cell
        return None
