"""Measure each layer of an nn.Sequential at a micro-batch size: F, B, I, W seconds and bytes."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch import nn
from tqdm import tqdm

from split_backward import SplitMode, check_mode, trial_split
from partitioners.measure.cost import LayerCost, LossCost, Profile
from partitioners.measure.microbatch import first_microbatch
from partitioners.measure.tensors import (
    SavedBytes,
    detached,
    fresh_inputs,
    nbytes,
    storage_pointers,
    storages_of,
    tensors_of,
    to_device,
)
from partitioners.measure.timing import held_for_weights, run_full, run_loss, run_split
from units.unit import Unit

Sample = torch.Tensor | tuple[torch.Tensor, ...]


def profile(
    model: nn.Sequential,
    sample: Sample,
    device: str | torch.device = "cpu",
    warmup: int = 1,
    repeat: int = 3,
    progress: bool | None = None,
    *,
    microbatch_size: int | None = None,
    microbatches: int | None = None,
    loss_fn: Callable[..., Any] | None = None,
    target: Any = None,
    split_backward: SplitMode = "auto",
) -> Profile:
    """Measure every layer of ``model`` on one micro-batch, one LayerCost per layer, in order.

    The micro-batch flows layer to layer as in the model (a layer may take and
    return a tuple). Per layer, on its real input: the forward; the full backward,
    given a gradient of ones shaped like its output; and, on a second forward, the
    split backward: I, the gradient with respect to the layer's input only (graph
    kept), then W, the gradient with respect to its parameters. Times are medians
    over ``repeat`` runs after ``warmup`` runs, synchronised on CUDA. Profiling runs
    in training mode with autograd on, on ``device``: the model is moved there and back.

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
        sample: input, a tensor, or a tuple or dict of tensors (the first layer's
            argument; for ``units.cut_model``'s units, the batch as the model takes it): one micro-batch, or the whole
            batch with ``microbatch_size`` or ``microbatches``.
        device: where to run, e.g. ``"cpu"`` or ``"cuda:0"``: the stage's device.
        warmup: untimed runs per layer before the timed ones, >= 0.
        repeat: timed runs per layer, >= 1; the median is kept.
        progress: show a progress bar over layers; None shows it when stderr is a terminal.
        microbatch_size: measure the first ``microbatch_size`` rows (dim 0) of the
            sample. Costs are far from linear in the rows, so measure the size the
            pipeline will run.
        microbatches: measure the largest of ``microbatches`` micro-batches the
            sample's batch splits into (``ceil(rows / microbatches)`` rows, as
            ``torch.tensor_split`` and the pipeline split it).
        loss_fn: ``loss_fn(output, target)``, measured on the last layer's output:
            its forward and its backward, in ``Profile.loss``.
        target: the loss target for the whole sample (cut like the sample).
        split_backward: how I and W split, as ``Pipe(split_backward=...)``: each layer's
            I and W (and ``weight_bytes``) are timed as a chunk runs them after its
            first I (``split_backward.trial_split``).

    Returns:
        A Profile: a list with one LayerCost per layer (forward, backward,
        backward_input, backward_weight seconds, ``param_bytes``,
        ``activation_bytes`` a.k.a. ``output_bytes``, the output a cut after the
        layer sends, and ``saved_bytes``, what autograd keeps for its backward,
        parameters excluded, counted with ``torch.autograd.graph.saved_tensors_hooks``),
        plus ``loss``, ``microbatch_size`` and ``device``.

    Raises:
        TypeError: ``model`` is not an ``nn.Sequential``, or ``sample`` is not a
            tensor, or a tuple or dict of tensors.
        ValueError: an empty model, ``warmup``/``repeat``/``microbatch_size``/
            ``microbatches`` out of range, both of the last two, ``loss_fn``
            without ``target`` or the reverse, or a device this machine does not
            have (e.g. ``"cuda"`` without CUDA).
        RuntimeError: a layer or the loss failed; the message names it.
    """
    _check_arguments(model, sample, warmup, repeat)
    split_backward = check_mode(split_backward)
    if (loss_fn is None) != (target is None):
        given = "loss_fn without a target" if target is None else "a target without loss_fn"
        raise ValueError(f"expected loss_fn and target together, or neither; got {given}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    sample, target, rows = first_microbatch(sample, target, microbatch_size, microbatches)
    device_ = _check_device(device)
    show = sys.stderr.isatty() if progress is None else progress
    with ExitStack() as stack:
        stack.enter_context(_preserved(model))
        if isinstance(loss_fn, nn.Module):
            stack.enter_context(_preserved(loss_fn))
            loss_fn.to(device_)
        stack.enter_context(_forked_rng(device_))
        stack.enter_context(torch.enable_grad())
        model.train()
        model.to(device_)
        inputs = to_device(sample, device_)
        if warmup:
            _warm_up(model, inputs, device_)
        layers = tqdm(
            model, desc="profile", unit="layer", disable=not show, file=sys.stderr, leave=False
        )
        costs, inputs, kept_output = _measure_layers(layers, inputs, device_, warmup, repeat,
                                                     split_backward)
        loss = None
        if loss_fn is not None:
            loss = _measure_loss(loss_fn, inputs, to_device(target, device_), device_,
                                 warmup, repeat, kept_output)
    return Profile(costs, loss=loss, microbatch_size=rows, device=str(device_))


def _measure_layers(
    layers: Any, inputs: Any, device: torch.device, warmup: int, repeat: int,
    split_backward: SplitMode = "auto",
) -> tuple[list[LayerCost], Any, list[bool]]:
    """Every layer's cost, in order, the last layer's (detached) output, and which of its
    tensors the last layer saves."""
    costs = []
    charged: dict[int, int] = {}
    kept_output: list[bool] = []  # per output tensor of the layer before: did it save it?
    for index, layer in enumerate(layers):
        try:
            cost, inputs, kept_output = _measure(layer, inputs, index > 0, device, warmup,
                                                 repeat, charged, kept_output, index,
                                                 split_backward)
        except Exception as error:  # noqa: BLE001 - re-raised with the layer named
            raise RuntimeError(
                f"profiling layer {index} ({type(layer).__name__}) failed: {error}"
            ) from error
        costs.append(cost)
    return costs, inputs, kept_output


def _measure_loss(
    loss_fn: Callable[..., Any],
    output: Any,
    target: Any,
    device: torch.device,
    warmup: int,
    repeat: int,
    kept_before: list[bool],
) -> LossCost:
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    try:
        saved = _loss_saved_bytes(loss_fn, output, target, kept_before)
        forwards, backwards = [], []
        for run in range(warmup + repeat):
            forward, backward = run_loss(loss_fn, output, target, device)
            if run >= warmup:
                forwards.append(forward)
                backwards.append(backward)
    except Exception as error:  # noqa: BLE001 - re-raised with the loss named
        raise RuntimeError(
            f"profiling the loss ({name}) on the last layer's output failed: {error}"
        ) from error
    return LossCost(statistics.median(forwards), statistics.median(backwards), saved)


def _loss_saved_bytes(loss_fn: Callable[..., Any], output: Any, target: Any,
                      kept_before: list[bool]) -> int:
    """What the loss keeps for its backward, less the target (held anyway) and the output
    tensors the last layer keeps already."""
    counter = SavedBytes(exclude=storages_of(target))
    fresh = fresh_inputs(output, True)[0]
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        loss_fn(fresh, target)
    shared = sum(nbytes(tensor) for tensor, before in zip(tensors_of(fresh), kept_before)
                 if before and counter.saved(tensor))
    return max(counter.total - shared, 0)


def _check_arguments(model: Any, sample: Any, warmup: int, repeat: int) -> None:
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"expected an nn.Sequential, got {type(model).__name__}")
    if len(model) == 0:
        raise ValueError("expected an nn.Sequential with at least one layer, got an empty one")
    leaves = pytree.tree_leaves(sample)
    if not leaves or not any(isinstance(leaf, torch.Tensor) for leaf in leaves) or any(
            not isinstance(leaf, (torch.Tensor, bool, int, float, str, type(None)))
            for leaf in leaves):
        inside = ", ".join(sorted({type(leaf).__name__ for leaf in leaves})) or "nothing"
        raise TypeError(f"expected the sample to be a tensor, or a tuple or dict of tensors "
                        f"(a traced model's batch as it takes it), got "
                        f"{type(sample).__name__} (of {inside})")
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
    charged: dict[int, int],
    kept_before: list[bool],
    index: int = 0,
    split_backward: SplitMode = "auto",
) -> tuple[LayerCost, Any, list[bool]]:
    """Time one layer on ``inputs``; return its cost, its (detached) output, and per
    output tensor whether the layer saves it for its backward.

    ``charged`` maps the ids of parameters an earlier layer already counted to that
    layer: a shared parameter (a head tied to the embedding) is charged to its first
    layer only, and the later ones name it in ``tied``.
    ``kept_before`` says which of its input tensors the layer before saved (as outputs).
    """
    counter = SavedBytes(exclude=storage_pointers(layer))
    fresh = fresh_inputs(inputs, grad_input)[0]
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        output = layer(fresh)
    activation_bytes = nbytes(output)
    shared = sum(nbytes(tensor) for tensor, before in zip(tensors_of(fresh), kept_before)
                 if before and counter.saved(tensor))
    kept_input = sum(nbytes(tensor) for tensor in tensors_of(fresh) if counter.saved(tensor))
    kept_output = [counter.saved(tensor) for tensor in tensors_of(output)]
    del output, fresh
    times: dict[str, list[float]] = {"forward": [], "backward": [], "input": [], "weight": []}
    with trial_split(layer, split_backward) as split:
        weight_bytes = held_for_weights(layer, inputs, grad_input, storage_pointers(layer), split)
        for parameter in layer.parameters():
            parameter.grad = None
        for run in range(warmup + repeat):
            forward, backward, output = run_full(layer, inputs, grad_input, device)
            for parameter in layer.parameters():
                parameter.grad = None
            backward_input, backward_weight = run_split(layer, inputs, grad_input, device, split)
            for parameter in layer.parameters():
                parameter.grad = None
            if run >= warmup:
                for key, value in zip(times, (forward, backward, backward_input, backward_weight)):
                    times[key].append(value)
    median = {key: statistics.median(values) for key, values in times.items()}
    param_bytes, tied = _charge(layer, index, charged)
    cost = LayerCost(
        forward=median["forward"],
        backward=median["backward"],
        param_bytes=param_bytes,
        tied=tied,
        activation_bytes=activation_bytes,
        saved_bytes=counter.total,
        name=layer_name(layer),
        backward_input=median["input"],
        backward_weight=median["weight"],
        shared_input_bytes=min(shared, counter.total),
        weight_bytes=weight_bytes,
        kept_input_bytes=kept_input,
    )
    return cost, detached(output), kept_output


def layer_name(layer: nn.Module) -> str:
    """What a table calls the layer: a traced unit's name (``"model.layers.3"``,
    ``"(prologue)"``), else its type's (``"Linear"``)."""
    return layer.name if isinstance(layer, Unit) else type(layer).__name__


def _charge(layer: nn.Module, index: int, charged: dict[int, int]
            ) -> tuple[int, tuple[tuple[int, int], ...]]:
    """Bytes of the layer's parameters not in ``charged`` (which then names this layer for
    them), and per earlier layer, the bytes of its parameters this one uses too."""
    total = 0
    tied: dict[int, int] = {}
    for parameter in layer.parameters():
        size = parameter.numel() * parameter.element_size()
        owner = charged.setdefault(id(parameter), index)
        if owner == index:
            total += size
        else:
            tied[owner] = tied.get(owner, 0) + size
    return total, tuple(sorted(tied.items()))


def _warm_up(model: nn.Sequential, inputs: Any, device: torch.device) -> None:
    """One untimed forward and backward of the whole model.

    One-time costs (kernel selection, allocator growth, autograd threads) would
    otherwise land on the first layers' timed runs, whatever their own warm-up.
    """
    try:
        run_full(model, inputs, False, device)
    except Exception:  # noqa: BLE001 - the per-layer pass reports the failing layer
        pass
    for parameter in model.parameters():
        parameter.grad = None


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
