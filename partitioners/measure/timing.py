"""Time one module on fresh inputs: forward, full backward, split backward (I then W), a loss.

Every run feeds the module a private copy of its input (``fresh_inputs``), so an
in-place module cannot change what the next run or the caller sees. Clocks are
read after a device synchronisation, so queued GPU work lands on the op that
queued it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from split_backward import ChunkSplit
from partitioners.measure.tensors import fresh_inputs, storage_bytes, tensors_of


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "synchronize"):
            backend.synchronize()


def _roots(output: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The output tensors that need a gradient, and a gradient of ones for each."""
    roots = [t for t in tensors_of(output) if t.requires_grad]
    return roots, [torch.ones_like(t) for t in roots]


def _timed(device: torch.device, work: Callable[[], Any]) -> tuple[float, Any]:
    synchronize(device)
    start = time.perf_counter()
    result = work()
    synchronize(device)
    return time.perf_counter() - start, result


def run_full(
    module: nn.Module, inputs: Any, grad_input: bool, device: torch.device
) -> tuple[float, float, Any]:
    """One forward and one full backward: (forward seconds, backward seconds, output).

    Parameter gradients accumulate in ``.grad``; the caller clears them.
    """
    fresh, _ = fresh_inputs(inputs, grad_input)
    forward, output = _timed(device, lambda: module(fresh))
    roots, grads = _roots(output)
    backward = 0.0
    if roots:
        backward, _ = _timed(device, lambda: torch.autograd.backward(roots, grads))
    return forward, backward, output


def run_split(
    module: nn.Module, inputs: Any, grad_input: bool, device: torch.device, split: ChunkSplit
) -> tuple[float, float]:
    """A forward (untimed), then the split backward as the runtime runs it: (I seconds, W seconds).

    ``split`` is the module's ``ChunkSplit`` (``split_backward.trial_split``), switched on,
    as a chunk's is after its first I: layers that defer their weight gradients do, the
    graph split covers the rest. I is its ``backward_input`` (the input gradients, and
    what W needs); W is their ``run`` (the weight gradients only, accumulated into
    ``.grad``; the caller clears them). Either is 0 where there is nothing to do.
    """
    split.begin_step()
    fresh, leaves = fresh_inputs(inputs, grad_input)
    with split.forwarding(0):
        roots, grads = _roots(module(fresh))
    if not roots:
        return 0.0, 0.0
    # Without an input to differentiate (a first layer), I still runs the backward down to
    # the lowest products (``split_backward.first_stage``): timed as it runs.
    backward_input_seconds, (_, weights) = _timed(
        device, lambda: split.backward_input(roots, list(grads), leaves, 0))
    if weights.empty:
        return backward_input_seconds, 0.0
    backward_weight_seconds, _ = _timed(device, weights.run)
    return backward_input_seconds, backward_weight_seconds


def held_for_weights(module: nn.Module, inputs: Any, grad_input: bool, exclude: set[int],
                     split: ChunkSplit) -> int | None:
    """Bytes a forward then I (of ``split``, as in ``run_split``) leave alive for W,
    storages in ``exclude`` (parameters) aside.

    Returns:
        The bytes of the saved tensors W reads, the gradients I captured and what the
        deferring layers recorded, or None where the whole graph stays until W (a node
        without a weight rule).
    """
    split.begin_step()
    fresh, leaves = fresh_inputs(inputs, grad_input)
    with split.forwarding(0):
        roots, grads = _roots(module(fresh))
    if not roots:
        return 0
    _, weights = split.backward_input(roots, list(grads), leaves, 0)
    if weights.keeps_graph:
        return None
    return storage_bytes(weights.held(), exclude)


def run_loss(
    loss_fn: Callable[..., Any], output: Any, target: Any, device: torch.device
) -> tuple[float, float]:
    """The loss on ``output`` (a fresh leaf needing grad) and ``target``: (forward, backward)."""
    fresh, _ = fresh_inputs(output, True)
    forward, loss = _timed(device, lambda: loss_fn(fresh, target))
    roots, grads = _roots(loss)
    backward = 0.0
    if roots:
        backward, _ = _timed(device, lambda: torch.autograd.backward(roots, grads))
    return forward, backward
