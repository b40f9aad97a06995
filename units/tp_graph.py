"""Megatron's two boundaries placed in a traced graph: where a split region begins and ends.

A graph traced at one rank's sizes (``tp_local.localized``) computes a split region's
shard on each rank; ``place_boundaries`` makes the ranks agree at its edges:

- ``enter`` (Megatron's *f*) on the input of every column-split product: the identity
  forward, the ranks' partial input gradients summed (one all-reduce) backward. One per
  input: the q, k and v projections of one normed value share it.
- ``leave`` (*g*) on the output of every row-split product: the ranks' partial sums summed
  forward (one all-reduce), the identity backward; the bias is added after the sum, once.
- ``enter`` on each parameter of a ``"replicated_with_grad_allreduce"`` module where the
  graph reads it: its gradient from each rank's split values is summed.

So a transformer block costs one all-reduce per split pair forward and one backward, as in
Megatron. ``Boundaries`` counts them (calls and bytes, each way) for tests and benchmarks.

Randomness: a stage's tp ranks run each unit under one seed (the runtime agrees on the
step's), so a region every rank computes whole (a residual dropout) draws the same numbers
on each, as its values must agree. A random op inside a split region (attention dropout on
a rank's heads) draws apart: it runs under a seed made from the generator's state and the
rank, and leaves the state as it found it, so each shard gets a mask of its own (Megatron's
model-parallel generator), the shared stream stays in step across the ranks, and a
recomputed forward draws the same masks again.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.utils import _pytree as pytree

from units.errors import TraceError
from units.tp_plan import Style

_LINEAR = torch.ops.aten.linear.default
_ADDMM = torch.ops.aten.addmm.default
_MM = torch.ops.aten.mm.default
_ADD = torch.ops.aten.add.Tensor


@dataclass
class Counts:
    """All-reduces a rank's boundaries ran: calls and bytes, forward and backward."""

    forward: int = 0
    backward: int = 0
    forward_bytes: int = 0
    backward_bytes: int = 0


@dataclass(eq=False)
class Boundaries:
    """The ``tp`` group's two boundaries, as functions a graph calls (``enter``, ``leave``),
    and its random ops that draw apart per rank (``apart``)."""

    group: dist.ProcessGroup
    counts: Counts = field(default_factory=Counts)
    rank: int = 0  # this process's rank in ``group``
    timeout: float | None = None  # seconds an all-reduce may wait for the others (the Pipe's)

    def __post_init__(self) -> None:
        boundaries = self
        self._apart: dict[Any, Any] = {}

        def tp_enter(value: torch.Tensor) -> torch.Tensor:
            return _Enter.apply(value, boundaries)  # type: ignore[no-untyped-call,no-any-return]

        def tp_leave(value: torch.Tensor) -> torch.Tensor:
            return _Leave.apply(value, boundaries)  # type: ignore[no-untyped-call,no-any-return]

        self.enter = tp_enter
        self.leave = tp_leave

    def apart(self, op: Any) -> Any:
        """``op`` (a random op), drawing apart on each rank (one function per op)."""
        found = self._apart.get(op)
        if found is None:
            rank = self.rank

            def tp_draw_apart(*args: Any, **kwargs: Any) -> Any:
                with _drawing_apart(args, rank):
                    return op(*args, **kwargs)

            found = self._apart[op] = tp_draw_apart
        return found

    def summed(self, value: torch.Tensor, backward: bool) -> torch.Tensor:
        """``value`` summed over the group (a new tensor), counted."""
        total = value.contiguous().clone()
        work = dist.all_reduce(total, group=self.group, async_op=True)
        try:
            work.wait(None if self.timeout is None else timedelta(seconds=self.timeout))
        except RuntimeError as error:
            raise RuntimeError(
                f"a tensor-parallel all-reduce ({'backward' if backward else 'forward'}) "
                f"across the {dist.get_world_size(self.group)} tp ranks did not complete "
                f"within {self.timeout}s (a rank died, hung or is too slow: raise "
                f"Pipe(timeout=...)): {error}") from error
        size = total.numel() * total.element_size()
        if backward:
            self.counts.backward += 1
            self.counts.backward_bytes += size
        else:
            self.counts.forward += 1
            self.counts.forward_bytes += size
        return total


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, boundaries: Boundaries) -> torch.Tensor:
        ctx.boundaries = boundaries
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.boundaries.summed(grad, backward=True), None


class _Leave(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, boundaries: Boundaries) -> torch.Tensor:
        return boundaries.summed(value, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def place_boundaries(graph_module: fx.GraphModule, styles: dict[str, Style],
                     boundaries: Boundaries) -> None:
    """Put ``boundaries`` around the split products of ``graph_module`` (traced at one rank's
    sizes), in place.

    Raises:
        TraceError: a planned module's weight read by something other than its product.
    """
    graph = graph_module.graph
    role = _roles(graph_module, styles)
    entered: dict[fx.Node, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op == "get_attr" and role.get(str(node.target)) == "replicated":
            _enter_parameter(graph, node, boundaries)
            continue
        if node.op != "call_function" or node.target not in (_LINEAR, _ADDMM):
            continue
        weight = node.args[1] if node.target is _LINEAR else node.args[2]
        if not isinstance(weight, fx.Node) or weight.op != "get_attr":
            continue
        kind = role.get(str(weight.target))
        if kind == "column":
            position = 0 if node.target is _LINEAR else 1
            value = node.args[position]
            if value not in entered:
                with graph.inserting_before(node):
                    entered[value] = _call(graph, boundaries.enter, value, node)
            node.update_arg(position, entered[value])
        elif kind == "row":
            _leave_after(graph, node, boundaries)
    planned = {path for path, kind in role.items() if kind in ("column", "row")}
    _check_read_by_products(graph, planned)
    for node in _split_random_ops(graph, boundaries):
        node.target = boundaries.apart(node.target)
    graph_module.recompile()


_RANDOM = {torch.ops.aten.dropout.default, torch.ops.aten.native_dropout.default,
           torch.ops.aten.feature_dropout.default, torch.ops.aten.alpha_dropout.default,
           torch.ops.aten.bernoulli.default, torch.ops.aten.bernoulli.p,
           torch.ops.aten.rand_like.default, torch.ops.aten.randn_like.default}
_ATTENTION = torch.ops.aten.scaled_dot_product_attention.default


def _split_random_ops(graph: fx.Graph, boundaries: Boundaries) -> list[fx.Node]:
    """The random ops between a column-split product and the row-split one's sum: what
    each rank computes on its own shard (attention's dropout on its heads)."""
    split: set[fx.Node] = set()
    found = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is boundaries.leave:
            continue
        entered = node.target in (_LINEAR, _ADDMM) and any(
            isinstance(arg, fx.Node) and arg.target is boundaries.enter for arg in node.args)
        if entered or any(arg in split for arg in node.all_input_nodes):
            split.add(node)
            if node.target in _RANDOM or (node.target is _ATTENTION
                                          and _dropout_p(node) not in (0, 0.0)):
                found.append(node)
    return found


def _dropout_p(node: fx.Node) -> Any:
    if "dropout_p" in node.kwargs:
        return node.kwargs["dropout_p"]
    return node.args[4] if len(node.args) > 4 else 0.0


@contextmanager
def _drawing_apart(args: Any, rank: int) -> Iterator[None]:
    """Run the body under a seed of this generator state and ``rank``, the state restored."""
    device = next((leaf.device for leaf in pytree.tree_leaves(args)
                   if isinstance(leaf, torch.Tensor)), torch.device("cpu"))
    on_cuda = device.type == "cuda"
    state = torch.cuda.get_rng_state(device) if on_cuda else torch.get_rng_state()
    seed = (zlib.crc32(state.numpy().tobytes()) * 1_000_003 + rank) % (2**63 - 1)
    if on_cuda:
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        if on_cuda:
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)


def _roles(graph_module: fx.GraphModule, styles: dict[str, Style]) -> dict[str, str]:
    """Each planned parameter's path -> ``"column"``, ``"row"`` (its weight) or
    ``"replicated"`` (a parameter summed backward); a split bias has no role of its own."""
    roles: dict[str, str] = {}
    for name, style in styles.items():
        if style.name == "replicated_with_grad_allreduce":
            for node in graph_module.graph.nodes:
                if node.op == "get_attr" and str(node.target).rpartition(".")[0] == name:
                    roles[str(node.target)] = "replicated"
            continue
        roles[f"{name}.weight"] = "row" if style.name == "rowwise" else "column"
    return roles


def _call(graph: fx.Graph, function: Any, value: fx.Node, beside: fx.Node) -> fx.Node:
    node = graph.call_function(function, (value,))
    node.meta = {key: beside.meta[key] for key in ("nn_module_stack", "stack_trace")
                 if key in beside.meta}
    if "val" in value.meta:
        node.meta["val"] = value.meta["val"]
    return node


def _leave_after(graph: fx.Graph, product: fx.Node, boundaries: Boundaries) -> None:
    """``product`` (a row-split linear or addmm) summed over the ranks, its bias added after."""
    users = list(product.users)
    if product.target is _LINEAR:
        value, weight, *rest = product.args
        bias = rest[0] if rest else product.kwargs.get("bias")
        product.args = (value, weight)
        product.kwargs = {}
    else:
        bias, value, weight = product.args[:3]
        if product.kwargs or len(product.args) > 3:
            raise TraceError(f"a row-split Conv1D product scaled by beta or alpha "
                             f"({product.format_node()}) is not split here")
        product.target = _MM
        product.args = (value, weight)
    with graph.inserting_after(product):
        summed = _call(graph, boundaries.leave, product, product)
    result = summed
    if bias is not None:
        with graph.inserting_after(summed):
            result = graph.call_function(_ADD, (summed, bias))
            result.meta = dict(summed.meta)
    for user in users:
        user.replace_input_with(product, result)


def _enter_parameter(graph: fx.Graph, parameter: fx.Node, boundaries: Boundaries) -> None:
    users = list(parameter.users)
    if not users:
        return
    first = min(users, key=_position(graph))
    with graph.inserting_before(first):
        entered = _call(graph, boundaries.enter, parameter, first)
    for user in users:
        user.replace_input_with(parameter, entered)


def _position(graph: fx.Graph) -> Any:
    order = {node: index for index, node in enumerate(graph.nodes)}
    return order.__getitem__


def _check_read_by_products(graph: fx.Graph, planned: set[str]) -> None:
    for node in graph.nodes:
        if node.op != "get_attr" or str(node.target) not in planned:
            continue
        for user in node.users:
            if user.op == "call_function" and user.target in (_LINEAR, _ADDMM, _MM):
                continue
            raise TraceError(
                f"{node.target!r} is split by the tensor-parallel plan, but the graph also "
                f"reads it in {user.format_node()}: only its layer's own product can use a "
                f"shard; leave that module out of the plan")

