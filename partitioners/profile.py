"""Measure each layer of an nn.Sequential: forward and backward seconds, and its bytes."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from partitioners.cost import LayerCost
from partitioners.tensors import (
    SavedBytes,
    detached,
    nbytes,
    fresh_inputs,
    storage_pointers,
    to_device,
)

Sample = torch.Tensor | tuple[torch.Tensor, ...]


def profile(
    model: nn.Sequential,
    sample: Sample,
    device: str | torch.device = "cpu",
    warmup: int = 1,
    repeat: int = 3,
    progress: bool | None = None,
) -> list[LayerCost]:
    """Measure every layer of ``model`` on ``sample``, one LayerCost per layer, in order.

    The sample flows layer to layer as in the model (a layer may take and return a
    tuple). Each layer's forward is timed on its real input, and its backward alone,
    given a gradient of ones shaped like its output; times are medians over
    ``repeat`` runs after ``warmup`` runs, synchronised on CUDA. Profiling runs in
    training mode with autograd on, on ``device``: the model is moved there and back.

    Afterwards the model is as it was: the training flag of every module, parameter
    ``.grad`` (profiling's own gradients are dropped), buffers such as BatchNorm's
    running statistics, the device of every tensor, and the global RNG state. The
    sample is never written to: every run feeds a layer a copy of its input, so
    in-place layers (``ReLU(inplace=True)``, ``x.mul_()``) are measured as they run.

    A parameter shared by several layers (a head tied to the embedding) is counted
    once, in the ``param_bytes`` of the first layer that uses it; summing
    ``param_bytes`` over layers gives the model's parameter bytes.

    Args:
        model: the model to measure, an ``nn.Sequential`` of at least one layer.
        sample: one micro-batch of input, a tensor or a tuple of tensors.
        device: where to run, e.g. ``"cpu"`` or ``"cuda:0"``.
        warmup: untimed runs per layer before the timed ones, >= 0.
        repeat: timed runs per layer, >= 1; the median is kept.
        progress: show a progress bar over layers; None shows it when stderr is a terminal.

    Returns:
        One LayerCost per layer: forward and backward seconds, ``param_bytes``,
        ``activation_bytes`` (the output, what a cut after the layer sends) and
        ``saved_bytes`` (what autograd keeps for its backward, parameters excluded,
        measured with ``torch.autograd.graph.saved_tensors_hooks``).

    Raises:
        TypeError: ``model`` is not an ``nn.Sequential``, or ``sample`` is not a
            tensor or a tuple of tensors.
        ValueError: an empty model, ``warmup``/``repeat`` out of range, or a device
            this machine does not have (e.g. ``"cuda"`` without CUDA).
        RuntimeError: a layer failed; the message names it.
    """
    _check_arguments(model, sample, warmup, repeat)
    target = _check_device(device)
    show = sys.stderr.isatty() if progress is None else progress
    with _preserved(model), _forked_rng(target), torch.enable_grad():
        model.train()
        model.to(target)
        inputs = to_device(sample, target)
        if warmup:
            _warm_up(model, inputs, target)
        costs = []
        charged: set[int] = set()
        layers = tqdm(
            model, desc="profile", unit="layer", disable=not show, file=sys.stderr, leave=False
        )
        for index, layer in enumerate(layers):
            try:
                cost, inputs = _measure(layer, inputs, index > 0, target, warmup, repeat, charged)
            except Exception as error:  # noqa: BLE001 - re-raised with the layer named
                raise RuntimeError(
                    f"profiling layer {index} ({type(layer).__name__}) failed: {error}"
                ) from error
            costs.append(cost)
    return costs


def _check_arguments(model: Any, sample: Any, warmup: int, repeat: int) -> None:
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"expected an nn.Sequential, got {type(model).__name__}")
    if len(model) == 0:
        raise ValueError("expected an nn.Sequential with at least one layer, got an empty one")
    items = sample if isinstance(sample, (tuple, list)) else (sample,)
    if not items or not all(isinstance(item, torch.Tensor) for item in items):
        given = ", ".join(type(item).__name__ for item in items) or "an empty tuple"
        raise TypeError(f"expected the sample to be a tensor or a tuple of tensors, got {given}")
    for name, value, least in (("warmup", warmup, 0), ("repeat", repeat, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def _check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device, if this machine has it."""
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(
            f"expected a device such as 'cpu' or 'cuda:0', got {device!r}: {error}"
        ) from None
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"cannot profile on device {str(target)!r}: CUDA is not available here "
                f"(torch {torch.__version__}); expected device='cpu' or a machine with CUDA"
            )
        count = torch.cuda.device_count()
        if target.index is not None and target.index >= count:
            raise ValueError(
                f"cannot profile on device {str(target)!r}: expected a CUDA index below "
                f"{count} (this machine has {count} CUDA device{'s' if count != 1 else ''})"
            )
    return target


def _measure(
    layer: nn.Module,
    inputs: Any,
    grad_input: bool,
    device: torch.device,
    warmup: int,
    repeat: int,
    charged: set[int],
) -> tuple[LayerCost, Any]:
    """Time one layer on ``inputs``; return its cost and its (detached) output.

    ``charged`` holds the ids of parameters an earlier layer already counted: a shared
    parameter (a head tied to the embedding) is charged to its first layer only.
    """
    counter = SavedBytes(exclude=storage_pointers(layer))
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        output = layer(fresh_inputs(inputs, grad_input)[0])
    activation_bytes = nbytes(output)
    del output
    forwards, backwards = [], []
    for run in range(warmup + repeat):
        forward, backward, output = _run(layer, inputs, grad_input, device)
        for parameter in layer.parameters():
            parameter.grad = None
        if run >= warmup:
            forwards.append(forward)
            backwards.append(backward)
    cost = LayerCost(
        forward=statistics.median(forwards),
        backward=statistics.median(backwards),
        param_bytes=_charge(layer, charged),
        activation_bytes=activation_bytes,
        saved_bytes=counter.total,
        name=type(layer).__name__,
    )
    return cost, detached(output)


def _charge(layer: nn.Module, charged: set[int]) -> int:
    """Bytes of the layer's parameters not in ``charged``, which then holds them all."""
    total = 0
    for parameter in layer.parameters():
        if id(parameter) not in charged:
            charged.add(id(parameter))
            total += parameter.numel() * parameter.element_size()
    return total


def _warm_up(model: nn.Sequential, inputs: Any, device: torch.device) -> None:
    """One untimed forward and backward of the whole model.

    One-time costs (kernel selection, allocator growth, autograd threads) would
    otherwise land on the first layers' timed runs, whatever their own warm-up.
    """
    try:
        _run(model, inputs, False, device)
    except Exception:  # noqa: BLE001 - the per-layer pass reports the failing layer
        pass
    for parameter in model.parameters():
        parameter.grad = None


def _run(
    layer: nn.Module, inputs: Any, grad_input: bool, device: torch.device
) -> tuple[float, float, Any]:
    """One forward and one backward of ``layer``, each timed: (seconds, seconds, output)."""
    fresh, _ = fresh_inputs(inputs, grad_input)
    _synchronize(device)
    start = time.perf_counter()
    output = layer(fresh)
    _synchronize(device)
    forward = time.perf_counter() - start
    items = output if isinstance(output, (tuple, list)) else (output,)
    roots = [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = [torch.ones_like(t) for t in roots]
    _synchronize(device)
    start = time.perf_counter()
    if roots:
        torch.autograd.backward(roots, grads)
    _synchronize(device)
    return forward, time.perf_counter() - start, output


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "synchronize"):
            backend.synchronize()


@contextmanager
def _preserved(model: nn.Module) -> Iterator[None]:
    """Restore training flags, parameter data and grads, buffers and devices on exit."""
    modes = [(module, module.training) for module in model.modules()]
    parameters = [(p, p.data, p.grad) for p in model.parameters()]
    buffers = [
        (module, name, buffer, buffer.detach().clone())
        for module in model.modules()
        for name, buffer in module.named_buffers(recurse=False)
    ]
    for parameter, _, _ in parameters:
        parameter.grad = None
    try:
        yield
    finally:
        with torch.no_grad():
            for parameter, data, grad in parameters:
                parameter.data = data
                parameter.grad = grad
            for module, name, buffer, copy in buffers:
                buffer.copy_(copy)
                setattr(module, name, buffer)
        for module, mode in modes:
            module.training = mode


@contextmanager
def _forked_rng(device: torch.device) -> Iterator[None]:
    """Leave the global RNG state (CPU, and the CUDA device profiled on) as it was."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.random.fork_rng(devices=[index], device_type="cuda"):
            yield
    else:
        with torch.random.fork_rng(devices=[]):
            yield
