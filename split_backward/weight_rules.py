"""Weight-side gradients of common autograd nodes: what W needs, taken from the node before I.

W has to compute, for every junction (a node on the input chain with edges to
parameters), the gradients it sends along those edges, and only those. The
engine can do it (seed the junction, capture at its exits), but that keeps the
whole graph alive from I to W and costs tens of microseconds a call whatever it
computes, and a chunk of small layers has one junction per layer. For the
nodes real models are made of, a rule takes from the node, before I runs, only
the saved tensors its weight gradient needs (a Linear's input, a LayerNorm's
input and statistics) and returns the computation for later, with the kernel
autograd itself would run: ``aten.native_layer_norm_backward``,
``aten.convolution_backward`` and ``aten.native_batch_norm_backward`` take an
output mask; the matrix products are one product each. Once every junction of
a graph has a rule, I may free the graph as it goes, and what lives from I to W
is what the weight gradients read, not every activation of the chunk.

Every node with a rule has one output (the gradient entering it is the one the
engine captures at its slot 0). A rule answers only for the outputs asked for, unreduced where an input was
broadcast (the engine reduces it, as inside a backward). A node without a rule
goes through the engine (``split_backward.graph_split``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import Node

Compute = Callable[[torch.Tensor], dict[int, torch.Tensor]]


@dataclass(frozen=True)
class Deferred:
    """A junction's weight-side computation, waiting for the gradient I captures.

    Attributes:
        compute: gradient entering the node -> output index -> gradient.
        tensors: the saved tensors ``compute`` reads (what W keeps alive).
    """

    compute: Compute
    tensors: tuple[torch.Tensor, ...]


Rule = Callable[[Any, frozenset[int]], Deferred]


def _scaled(tensor: torch.Tensor, factor: Any) -> torch.Tensor:
    return tensor if factor == 1 else tensor * factor


def _present(*values: Any) -> tuple[torch.Tensor, ...]:
    return tuple(value for value in values if isinstance(value, torch.Tensor))


def _strided(*tensors: torch.Tensor | None) -> None:
    if any(t is not None and t.layout != torch.strided for t in tensors):
        raise TypeError("not a strided tensor")


def _column_major(node: Any) -> bool:
    # Linear multiplies by ``weight.t()``: a column-major mat2. Its gradient is then
    # computed transposed, as autograd does, so that it reaches the weight contiguous
    # and accumulates without a copy.
    strides, sizes = node._saved_mat2_sym_strides, node._saved_mat2_sym_sizes
    return len(strides) == 2 and strides[0] == 1 and strides[1] == sizes[0]


def _mat2_grad(mat1: torch.Tensor, grad: torch.Tensor, column_major: bool) -> torch.Tensor:
    if column_major:
        return grad.t().mm(mat1.conj()).t()
    return mat1.t().conj().mm(grad)


def _product(left: torch.Tensor | None, right: torch.Tensor | None, column_major: bool,
             alpha: Any, slots: tuple[int, int]) -> Compute:
    """``left @ right``'s gradients at ``slots`` (left's, right's): each needs the other."""

    def compute(grad: torch.Tensor) -> dict[int, torch.Tensor]:
        out = {}
        if right is not None:
            out[slots[0]] = _scaled(grad.mm(right.t().conj()), alpha)
        if left is not None:
            out[slots[1]] = _scaled(_mat2_grad(left, grad, column_major), alpha)
        return out

    return compute


def _addmm(node: Any, wanted: frozenset[int]) -> Deferred:
    # addmm(self, mat1, mat2, beta, alpha) = beta * self + alpha * mat1 @ mat2
    alpha, beta = node._saved_alpha.conjugate(), node._saved_beta.conjugate()
    mat2 = node._saved_mat2 if 1 in wanted else None
    mat1 = node._saved_mat1 if 2 in wanted else None
    _strided(mat1, mat2)
    product = _product(mat1, mat2, _column_major(node), alpha, (1, 2))

    def compute(grad: torch.Tensor) -> dict[int, torch.Tensor]:
        out = product(grad)
        if 0 in wanted:
            out[0] = _scaled(grad, beta)
        return out

    return Deferred(compute, _present(mat1, mat2))


def _mm(node: Any, wanted: frozenset[int]) -> Deferred:
    mat2 = node._saved_mat2 if 0 in wanted else None
    self = node._saved_self if 1 in wanted else None
    _strided(mat2, self)
    return Deferred(_product(self, mat2, _column_major(node), 1, (0, 1)), _present(mat2, self))


def _masked_call(
    kernel: Callable[..., Any], arguments: tuple[Any, ...], wanted: frozenset[int]
) -> Deferred:
    mask = [index in wanted for index in range(3)]

    def compute(grad: torch.Tensor) -> dict[int, torch.Tensor]:
        results = kernel(grad, *arguments, mask)
        return {index: t for index, t in enumerate(results) if index in wanted and t is not None}

    return Deferred(compute, _present(*arguments))


def _layer_norm(node: Any, wanted: frozenset[int]) -> Deferred:
    return _masked_call(torch.ops.aten.native_layer_norm_backward, (
        node._saved_input, node._saved_normalized_shape, node._saved_result1,
        node._saved_result2, node._saved_weight, node._saved_bias,
    ), wanted)


def _convolution(node: Any, wanted: frozenset[int]) -> Deferred:
    return _masked_call(torch.ops.aten.convolution_backward, (
        node._saved_input, node._saved_weight, node._saved_bias_sym_sizes_opt, node._saved_stride,
        node._saved_padding, node._saved_dilation, node._saved_transposed,
        node._saved_output_padding, node._saved_groups,
    ), wanted)


def _batch_norm(node: Any, wanted: frozenset[int]) -> Deferred:
    return _masked_call(torch.ops.aten.native_batch_norm_backward, (
        node._saved_input, node._saved_weight, node._saved_running_mean,
        node._saved_running_var, node._saved_result1, node._saved_result2,
        node._saved_training, node._saved_eps,
    ), wanted)


def _mul(node: Any, wanted: frozenset[int]) -> Deferred:
    other = node._saved_other if 0 in wanted else None
    self = node._saved_self if 1 in wanted else None

    def compute(grad: torch.Tensor) -> dict[int, torch.Tensor]:
        out = {}
        if other is not None:
            out[0] = grad * other.conj()
        if self is not None:
            out[1] = grad * self.conj()
        return out

    return Deferred(compute, _present(other, self))


def _add(sign: int) -> Rule:
    def rule(node: Any, wanted: frozenset[int]) -> Deferred:
        alpha = sign * node._saved_alpha.conjugate()

        def compute(grad: torch.Tensor) -> dict[int, torch.Tensor]:
            out = {}
            if 0 in wanted:
                out[0] = grad
            if 1 in wanted:
                out[1] = _scaled(grad, alpha)
            return out

        return Deferred(compute, ())

    return rule


RULES: dict[str, Rule] = {
    "AddmmBackward0": _addmm,
    "MmBackward0": _mm,
    "NativeLayerNormBackward0": _layer_norm,
    "ConvolutionBackward0": _convolution,
    "NativeBatchNormBackward0": _batch_norm,
    "MulBackward0": _mul,
    "AddBackward0": _add(1),
    "SubBackward0": _add(-1),
}


# Norms whose weight gradients are reductions their input gradient computes anyway
# (sum(g) and sum(g * x_hat) over the normalised dimensions): one call of the backward
# kernel gives all three at about the price of the input gradient alone. I computes their
# weight gradients with the input's (``split_backward.graph_split``): deferring them
# would run the kernel a second time in W and keep the gradient entering the norm (a
# whole activation) alive until then; which also stops the engine from adding the other
# branch of a residual into that gradient in place (it is held), so I would allocate
# and fill a new activation-sized buffer at every such add.
FUSED: frozenset[str] = frozenset({
    "NativeLayerNormBackward0", "NativeBatchNormBackward0", "CudnnBatchNormBackward0",
    "MiopenBatchNormBackward0", "NativeGroupNormBackward0",
})


def fused(node: Node) -> bool:
    """Whether I computes ``node``'s weight gradients with its input gradient (``FUSED``)."""
    return node.name() in FUSED


def prepare(node: Node, wanted: frozenset[int]) -> Deferred | None:
    """Take from ``node`` what its outputs ``wanted`` need, before I runs.

    Returns:
        A function of the gradient entering the node (the one I captures) giving
        output index -> gradient, or None where no rule covers the node (the
        engine must then run it, and the graph must live until W).
    """
    rule = RULES.get(node.name())
    if rule is None:
        return None
    try:
        return rule(node, wanted)
    except (RuntimeError, AttributeError, TypeError):
        # A saved tensor the rule needs was not kept, or is not strided: the engine
        # knows what to do with it.
        return None
