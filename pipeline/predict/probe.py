"""Measure one model chunk as the runtime runs it: F, B, I, W seconds and saved bytes.

Why through a ``ChunkRunner`` and not layer by layer: the runtime runs a chunk's
layers as a unit, with its saved-tensor hooks (the activation tracker), its
per-layer RNG streams, its input copies and its stash, and a sum of per-layer
timings misses all of that and the calls between layers. A probe is a second
``ChunkRunner`` over the *same* layers (so the same parameters, on the same
device), with its own tracker and checkpoint mode, run on one micro-batch of
the size the step will run. What a training step would change is put back:
parameter ``.grad`` (set aside, then restored), buffers such as BatchNorm's
running statistics (copied, then written back), and the global RNG state
(forked). Parameters are never written: no optimizer runs.

A stage sharded by FSDP2 is probed with every unit gathered
(``runner.data_parallel.gathered()``, which ``predict.step`` enters): probes and
contention loops then run no collective (a loop timed by the clock would run a count of
them that differs between replicas, and wait forever), time compute alone (what the
replicas' collectives cost is modelled apart, ``pipeline.predict.overheads``), and count
saved bytes against the gathered parameters they alias.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from schedules.recompute import CheckpointMode

from pipeline.compute.activations import ActivationTracker
from pipeline.compute.chunk import ChunkRunner
from pipeline.payloads.tree import differentiable, flatten
from pipeline.payloads.values import crossing

WARMUP = 2
REPEAT = 5


@crossing
@dataclass(frozen=True)
class ChunkCosts:
    """What one micro-batch costs on one chunk, as measured by ``probe_chunk``.

    Attributes:
        chunk: the chunk's index in the model.
        forward: seconds of a forward that keeps its graph (the loss included on the
            last chunk).
        backward: seconds of the full backward B.
        input_grad, weight_grad: seconds of the split backward's I and W (0 when the
            schedule does not split).
        recompute_forward: seconds of the forward of a recomputed micro-batch (no
            graph kept); equal to ``forward`` with ``checkpoint="never"``.
        recompute_backward, recompute_input_grad: seconds of B and I of a recomputed
            micro-batch, its re-run forward included.
        saved_bytes: bytes autograd keeps from one forward, as the runtime's tracker
            counts them.
        weight_bytes: bytes still held between the split backward's I and W (the
            saved tensors W reads and the gradients I captured); ``saved_bytes``
            when the schedule does not split.
        input_bytes: bytes of the chunk's input (a hop's payload, and what a
            recomputed micro-batch keeps).
        output_bytes: bytes of what the chunk sends on (0 for the last chunk).
        exchange: seconds of its forward spent waiting on expert all-to-alls
            (``units.ep_dispatch.Exchange``), its backward as long: what an overlapped
            pair can hide (``Costs.exchange``).
    """

    chunk: int
    forward: float
    backward: float
    input_grad: float
    weight_grad: float
    recompute_forward: float
    recompute_backward: float
    recompute_input_grad: float
    saved_bytes: int
    input_bytes: int
    output_bytes: int
    weight_bytes: int = 0
    exchange: float = 0.0


def payload_bytes(payload: Any) -> int:
    """Bytes of every tensor of a payload."""
    return sum(t.numel() * t.element_size() for t in flatten(payload).tensors)


def probe_chunk(
    chunk: ChunkRunner,
    inputs: Any,
    target: Any,
    microbatches: int,
    split: bool,
    recompute: bool,
    warmup: int = WARMUP,
    repeat: int = REPEAT,
) -> tuple[ChunkCosts, Any]:
    """Time ``chunk`` on one micro-batch, leaving the model as it was.

    Args:
        chunk: the runtime's runner of this chunk (its layers, device, options).
        inputs: the micro-batch the chunk receives, on its device.
        target: the micro-batch's target for the last chunk, else None.
        microbatches: micro-batches per step (the runtime's per-step bookkeeping).
        split: whether the schedule splits backwards into I and W.
        recompute: also time the forward and backward of a recomputed micro-batch.
        warmup: untimed runs before the timed ones.
        repeat: timed runs; medians are kept.

    Returns:
        The ChunkCosts and the chunk's output for this micro-batch (detached; the
        loss for the last chunk).
    """
    with untouched(chunk):
        counting = probe_runner(chunk, "never", tracked=True)
        counting.begin_step(0, microbatches)
        output, saved = _saved_by_forward(counting, inputs, target, split)
        kept_for_w = _kept_for_weights(counting, output) if split else saved
        counting.begin_step(0, microbatches)
        # Timed as the runtime runs: with the tracker's hooks only if the Pipe has them.
        tracked = chunk.tracker is not None
        graph = probe_runner(chunk, "never", tracked)
        graph.begin_step(0, microbatches)
        plain = _time_runs(graph, inputs, target, split, warmup, repeat)
        again = plain
        if recompute:
            redo = probe_runner(chunk, "always", tracked)
            redo.begin_step(0, microbatches)
            again = _time_runs(redo, inputs, target, split, warmup, repeat)
            redo.begin_step(0, microbatches)
        graph.begin_step(0, microbatches)
    costs = ChunkCosts(
        chunk=chunk.spec.index,
        forward=plain["F"],
        backward=plain["B"],
        input_grad=plain.get("I", 0.0),
        weight_grad=plain.get("W", 0.0),
        recompute_forward=again["F"],
        recompute_backward=again["B"],
        recompute_input_grad=again.get("I", 0.0),
        saved_bytes=saved,
        weight_bytes=kept_for_w,
        input_bytes=payload_bytes(inputs),
        output_bytes=0 if chunk.spec.is_last else payload_bytes(output),
    )
    return costs, output


def probe_runner(chunk: ChunkRunner, checkpoint: CheckpointMode, tracked: bool) -> ChunkRunner:
    """A runner over the chunk's own layers with another checkpoint mode and, if ``tracked``,
    its own activation tracker."""
    parameters = list(chunk.layers.parameters())
    tracker = ActivationTracker(parameters, 1.0) if tracked else None
    if tracker is not None:
        tracker.measuring = True
    return ChunkRunner(chunk.spec, chunk.layers, chunk.device,
                       replace(chunk.options, checkpoint=checkpoint),
                       tracker, chunk.rng_lock, chunk.grad_lock, chunk.sharded)


def _saved_by_forward(runner: ChunkRunner, inputs: Any, target: Any,
                      split: bool = False) -> tuple[Any, int]:
    """One forward keeping its graph (micro-batch 1): its output and the bytes the tracker saw
    it save. Micro-batch 0 runs and is dropped first: the first forward of a step runs on a
    copy of its input (to learn whether a layer writes it in place), which the others do not.
    With ``split`` its backward is an I and a W: a chunk switches its deferring layers on at
    its first I, so micro-batch 1 saves and keeps what a step's later ones do."""
    tracker = runner.tracker
    assert tracker is not None
    first = runner.forward(0, inputs, target, 1.0)
    grads = ones_like_outputs(first, runner.spec.is_last)
    if split:
        runner.backward_input(0, grads)
        runner.backward_weight(0)
    else:
        runner.backward(0, grads)
    tracker.reset_peaks()
    before = tracker.report().peak_bytes
    output = runner.forward(1, inputs, target, 1.0)
    saved = tracker.report().peak_bytes - before
    return output, saved


def _kept_for_weights(runner: ChunkRunner, output: Any) -> int:
    """After ``_saved_by_forward``: the bytes micro-batch 1 still holds once its I ran."""
    tracker = runner.tracker
    assert tracker is not None
    runner.backward_input(1, ones_like_outputs(output, runner.spec.is_last))
    held = tracker.live_bytes()
    runner.backward_weight(1)
    return held


def ones_like_outputs(output: Any, is_last: bool) -> tuple[torch.Tensor, ...] | None:
    if is_last:
        return None
    return tuple(torch.ones_like(t) for t in flatten(output).leaves if differentiable(t))


def _time_runs(runner: ChunkRunner, inputs: Any, target: Any, split: bool, warmup: int,
               repeat: int) -> dict[str, float]:
    """Median seconds of F and B, and of I and W with ``split``, over ``repeat`` runs."""
    device, is_last = runner.device, runner.spec.is_last
    times: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": []}
    for index in range(warmup + repeat):
        keep = index >= warmup
        microbatch = 2 * index + 1  # never 0: the first micro-batch of a step probes RNG use
        output = _timed(device, times["F"] if keep else [],
                        lambda: runner.forward(microbatch, inputs, target, 1.0))
        grads = ones_like_outputs(output, is_last)
        _timed(device, times["B"] if keep else [], lambda: runner.backward(microbatch, grads))
        if not split:
            continue
        runner.forward(microbatch + 1, inputs, target, 1.0)
        _timed(device, times["I"] if keep else [],
               lambda: runner.backward_input(microbatch + 1, grads))
        _timed(device, times["W"] if keep else [],
               lambda: runner.backward_weight(microbatch + 1))
    return {op: statistics.median(values) for op, values in times.items() if values}


def _timed(device: torch.device, into: list[float], work: Callable[[], Any]) -> Any:
    from partitioners.measure.timing import synchronize

    synchronize(device)
    start = time.perf_counter()
    result = work()
    synchronize(device)
    into.append(time.perf_counter() - start)
    return result


@contextmanager
def untouched(chunk: ChunkRunner) -> Iterator[None]:
    """Afterwards ``.grad``, buffers and the global RNG state are as before the body."""
    parameters = list(dict.fromkeys(chunk.layers.parameters()))
    grads = [p.grad for p in parameters]
    buffers = [(b, b.detach().clone()) for b in chunk.layers.buffers()]
    devices = [chunk.device] if chunk.device.type == "cuda" else []
    for parameter in parameters:
        parameter.grad = None
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            yield
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
        for parameter, grad in zip(parameters, grads):
            parameter.grad = grad
