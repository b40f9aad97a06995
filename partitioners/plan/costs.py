"""A candidate plan's costs: per-chunk sums of layer costs as ``schedules.Costs``, and a bound.

The planner prices every candidate (schedule, micro-batch count, cut,
recomputation) with ``schedules.simulate``, so that one simulator is the model of
both time and memory. This module turns per-layer measurements and a cut into
the ``Costs`` that simulator reads, and gives a lower bound on the makespan that
``simulate`` will predict, cheap enough to skip most candidates unsimulated.

Memory, per chunk: ``fixed_bytes`` is ``(2 + optimizer_factor) x`` its parameter
bytes (the parameters, their gradients and the optimizer's state);
``activation_bytes`` is the ``saved_bytes`` of its layers (what a micro-batch's
forward keeps for its backward), plus its input where its first layer does not
save it (the runtime keeps it until the backward all the same); ``weight_bytes``
what stays from I to W (``weight_bytes_of``); ``input_bytes`` is the activation it receives,
the output of the layer before it: what a recomputed micro-batch keeps, and the
payload of its hops. The first chunk's input is the caller's batch, already in
memory whatever the pipeline does, so it counts 0. What data-parallel replicas add
(ring collectives) is ``partitioners.plan.replicas``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

from partitioners.measure.cost import (
    LayerCost,
    LossCost,
    Profile,
    check_ties,
    saved_bytes_of,
    weight_bytes_of,
)
from schedules.costs import hop_time
from schedules.dependencies import crossings
from schedules.recompute import check_mode, recomputed
from schedules import Costs, Link

Hop = float | Link
"""The time of one hop between stages: seconds, or ``Link(latency, bandwidth)`` by payload."""


@dataclass(frozen=True)
class ChunkSums:
    """Per model chunk of a cut, the sums of its layers' costs (the loss on the last chunk).

    Attributes:
        forward, backward, input_grad, weight_grad: seconds per micro-batch; a chunk
            measured without a split backward gets half its backward for each half.
        saved: bytes its forward keeps per micro-batch.
        params: its parameter bytes.
        weight: bytes it keeps per micro-batch from its I to its W.
        inputs: bytes of the activation it receives (0 for the first chunk).
        ties: ``(chunk, earlier chunk, bytes)``: parameters a chunk uses that an earlier
            chunk holds (``LayerCost.tied``); a stage without that chunk holds a copy.
        shard_groups: per chunk, the parameter bytes of each of its layers that holds some (an
            FSDP shard group each).
        exchange: per chunk, seconds of its forward (and as many of its backward) spent on
            expert all-to-alls; empty: none.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    input_grad: tuple[float, ...]
    weight_grad: tuple[float, ...]
    saved: tuple[int, ...]
    params: tuple[int, ...]
    inputs: tuple[int, ...]
    ties: tuple[tuple[int, int, int], ...] = ()
    weight: tuple[int, ...] = ()
    shard_groups: tuple[tuple[int, ...], ...] = ()
    exchange: tuple[float, ...] = ()


def chunk_sums(costs: Sequence[LayerCost], sizes: Sequence[int],
               overhead: float = 0.0) -> ChunkSums:
    """Sum ``costs`` over the chunks of the cut ``sizes`` (layers per chunk, in order).

    A ``Profile``'s loss is charged to the last chunk: its forward after the last
    layer's, its backward (an input gradient) before the last layer's. ``overhead``
    seconds (the runtime's own work per action) are added to each F, B, I and W.
    """
    check_ties(costs)
    loss = costs.loss if isinstance(costs, Profile) else None
    ends = list(accumulate(sizes, initial=0))
    chunk_of = [chunk for chunk, size in enumerate(sizes) for _ in range(size)]
    ties = tuple((chunk_of[layer], chunk_of[origin], nbytes)
                 for layer, cost in enumerate(costs) for origin, nbytes in cost.tied
                 if chunk_of[origin] != chunk_of[layer])
    fields: dict[str, list[float]] = {name: [] for name in ("F", "B", "I", "W")}
    saved, params, inputs, weight = [], [], [], []
    shard_groups: list[tuple[int, ...]] = []
    for first, end in zip(ends, ends[1:]):
        layers = costs[first:end]
        forward = sum(cost.forward for cost in layers)
        backward = sum(cost.backward for cost in layers)
        input_grad = sum(cost.backward_input for cost in layers)
        weight_grad = sum(cost.backward_weight for cost in layers)
        if input_grad + weight_grad == 0:  # measured without a split backward
            input_grad = weight_grad = backward / 2
        elif first == 0 and costs[0].backward_input == 0:
            # The model's input needs no gradient: the first chunk's I has nothing to
            # compute, and its W is its whole backward.
            input_grad, weight_grad = 0.0, backward
        for name, value in zip(fields, (forward, backward, input_grad, weight_grad)):
            fields[name].append(value + overhead)
        received = costs[first - 1].activation_bytes if first else 0
        kept = layers[0].kept_input_bytes
        unsaved = 0 if kept is None else max(0, received - kept)
        saved.append(saved_bytes_of(layers) + unsaved)
        weight.append(weight_bytes_of(layers))
        params.append(sum(cost.param_bytes for cost in layers))
        shard_groups.append(tuple(cost.param_bytes for cost in layers if cost.param_bytes))
        inputs.append(received)
    if loss is not None:
        _charge_loss(fields, loss)
        saved[-1] += loss.saved_bytes
    return ChunkSums(
        tuple(fields["F"]), tuple(fields["B"]), tuple(fields["I"]), tuple(fields["W"]),
        saved=tuple(saved), params=tuple(params), inputs=tuple(inputs), ties=ties,
        weight=tuple(weight), shard_groups=tuple(shard_groups),
        exchange=tuple(sum(cost.exchange for cost in costs[first:end])
                       for first, end in zip(ends, ends[1:]))
        if any(cost.exchange for cost in costs) else (),
    )


def _charge_loss(fields: dict[str, list[float]], loss: LossCost) -> None:
    fields["F"][-1] += loss.forward
    fields["B"][-1] += loss.backward
    fields["I"][-1] += loss.backward


def microbatch_scale(batch: int, microbatches: int) -> tuple[float, ...]:
    """Each micro-batch's rows over the largest one's, as ``torch.tensor_split`` splits.

    The first ``batch % M`` micro-batches hold ``ceil(batch / M)`` rows, the rest
    one row fewer; costs are measured at the largest. Empty when all are equal.

    >>> microbatch_scale(10, 4)
    (1.0, 1.0, 0.6666666666666666, 0.6666666666666666)
    >>> microbatch_scale(8, 4)
    ()
    """
    largest, extra = -(-batch // microbatches), batch % microbatches
    if extra == 0:
        return ()
    return tuple(1.0 if m < extra else (largest - 1) / largest for m in range(microbatches))


def stage_params(sums: ChunkSums, placement: Sequence[int]) -> tuple[int, ...]:
    """Per chunk, its parameter bytes plus the copies of tied ones its stage holds.

    A chunk whose layers use parameters of an earlier chunk on another stage is charged a
    copy of them, once per stage and earlier chunk (``ChunkSums.ties``).
    """
    params = list(sums.params)
    for chunk, nbytes in tied_copies(sums, placement):
        params[chunk] += nbytes
    return tuple(params)


def tied_copies(sums: ChunkSums, placement: Sequence[int]) -> list[tuple[int, int]]:
    """``(chunk charged, bytes)`` of each copy of a tied parameter a stage holds."""
    copies: dict[tuple[int, int], tuple[int, int]] = {}  # (stage, origin): (chunk, bytes)
    for chunk, origin, nbytes in sums.ties:
        stage = placement[chunk]
        if placement[origin] != stage:
            charged, most = copies.get((stage, origin), (chunk, 0))
            copies[(stage, origin)] = (charged, max(most, nbytes))
    return list(copies.values())


def without_exchanges(sums: ChunkSums) -> ChunkSums:
    """``sums`` less the expert all-to-all time of every F, B and I: what overlapped pairs
    leave when they hide it all (a lower bound's costs)."""
    less = sums.exchange
    return replace(sums, forward=tuple(f - x for f, x in zip(sums.forward, less)),
                   backward=tuple(b - x for b, x in zip(sums.backward, less)),
                   input_grad=tuple(i - x for i, x in zip(sums.input_grad, less)))


def candidate_costs(
    sums: ChunkSums,
    scale: Sequence[float],
    checkpoint: str,
    hop: Hop = 0.0,
    optimizer_factor: float = 0.0,
    placement: Sequence[int] | None = None,
) -> Costs:
    """The ``schedules.Costs`` of one candidate: its chunk sums, split, recomputation and hop.

    With ``placement`` (the stage of each chunk), tied parameters are charged to every
    stage that holds a copy (``stage_params``).
    """
    params = sums.params if placement is None else stage_params(sums, placement)
    return Costs(
        forward=sums.forward,
        backward=sums.backward,
        input_grad=sums.input_grad,
        weight_grad=sums.weight_grad,
        comm=hop,
        microbatch_scale=tuple(scale),
        recompute=checkpoint,  # type: ignore[arg-type]
        activation_bytes=sums.saved,
        input_bytes=sums.inputs,
        fixed_bytes=tuple((2 + optimizer_factor) * p for p in params),
        weight_bytes=sums.weight or None,
        exchange=sums.exchange or 0.0,
    )


def makespan_lower_bound(
    sums: ChunkSums,
    placement: Sequence[int],
    split_backward: bool,
    scale: Sequence[float],
    recomputed: Sequence[bool],
    hop: Hop = 0.0,
) -> float:
    """A makespan no schedule of this placement can beat with these costs, without simulating.

    No stage starts before the first micro-batch to reach it has crossed the
    chunks before (forwards and hops, at the smallest micro-batch's size), and
    then it runs all its own work. A split schedule may run ``B`` or ``I`` then
    ``W``: each backward counts the cheaper. Every ``simulate`` makespan is at
    least this (up to rounding).

    Args:
        sums: the chunks' costs.
        placement: the stage of each chunk.
        split_backward: whether the schedule may split backwards into I and W.
        scale: one factor per micro-batch (see ``microbatch_scale``).
        recomputed: one bool per micro-batch, whether its forward is run again.
        hop: the hop model.
    """
    total_scale = sum(scale)
    redo = sum(s for s, again in zip(scale, recomputed) if again)
    smallest = min(scale)
    busy = [0.0] * (max(placement) + 1)
    for chunk, stage in enumerate(placement):
        backward = sums.backward[chunk]
        if split_backward:
            backward = min(backward, sums.input_grad[chunk] + sums.weight_grad[chunk])
        busy[stage] += (sums.forward[chunk] + backward) * total_scale + sums.forward[chunk] * redo
    arrival = [0.0] * len(placement)
    crossing = {chunk: (source, destination) for chunk, source, destination in crossings(placement)}
    for chunk in range(1, len(placement)):
        step = sums.forward[chunk - 1] * smallest
        if chunk - 1 in crossing:
            step += hop_time(hop, *crossing[chunk - 1], sums.inputs[chunk] * smallest)
        arrival[chunk] = arrival[chunk - 1] + step
    first = [float("inf")] * len(busy)
    for chunk, stage in enumerate(placement):
        first[stage] = min(first[stage], arrival[chunk])
    return max(start + work for start, work in zip(first, busy))


def recomputed_flags(checkpoint: str, microbatches: int) -> tuple[bool, ...]:
    """One bool per micro-batch: is its forward recomputed under ``checkpoint``."""
    return recomputed(check_mode(checkpoint), microbatches)


def linear_costs(costs: Sequence[LayerCost], rows: int) -> Callable[[int], list[LayerCost]]:
    """Costs at any micro-batch size, scaled in proportion to rows from one measured at ``rows``.

    A rough model (real layers are not linear in rows, least of all on a GPU:
    measure the sizes a plan will run where you can); it suits tests,
    benchmarks and a first look. Times and activation bytes scale, parameter
    bytes do not; a Profile's loss scales with the rest.

    Args:
        costs: per-layer costs measured at ``rows`` rows per micro-batch.
        rows: the micro-batch size they were measured at, >= 1.

    Returns:
        ``at(rows) -> Profile`` (ints rounded up).

    Raises:
        ValueError: ``rows`` < 1.
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be an int >= 1, got {rows!r}")
    loss = costs.loss if isinstance(costs, Profile) else None

    def at(size: int) -> Profile:
        factor = size / rows
        layers = [
            LayerCost(
                forward=cost.forward * factor, backward=cost.backward * factor,
                param_bytes=cost.param_bytes,
                activation_bytes=-(-cost.activation_bytes * size // rows),
                saved_bytes=-(-cost.saved_bytes * size // rows), name=cost.name,
                backward_input=cost.backward_input * factor,
                backward_weight=cost.backward_weight * factor,
                shared_input_bytes=min(-(-cost.shared_input_bytes * size // rows),
                                       -(-cost.saved_bytes * size // rows)),
                tied=cost.tied,
            )
            for cost in costs
        ]
        scaled = None if loss is None else LossCost(
            loss.forward * factor, loss.backward * factor, -(-loss.saved_bytes * size // rows))
        return Profile(layers, loss=scaled, microbatch_size=size)

    return at
