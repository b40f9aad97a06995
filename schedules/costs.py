"""Costs: what a calibrated model says each action, hop and held activation costs.

A ``Costs`` is a description, independent of any schedule: scalars or one value
per model chunk (or per stage), a scale per micro-batch, a hop model and bytes.
``Costs.resolve(schedule)`` checks it against a schedule and returns
``ResolvedCosts``, the per-chunk, per-op, per-micro-batch numbers the simulator
and the memory model read.

Precedence, from the most specific:

- an op's time: ``input_grad`` / ``weight_grad`` if given, else derived from
  ``backward`` (half each, or the remainder of the one given); ``backward`` if
  given, else ``input_grad + weight_grad`` when both are given, else
  ``2 x forward``;
- a micro-batch's time, payload and bytes: the chunk's value times
  ``microbatch_scale[m]``;
- a recomputed micro-batch (``recompute``): its ``B`` or ``I`` costs the
  chunk's ``F`` more, and until that backward it holds only ``input_bytes``;
- a split backward frees at the end of ``I`` all but ``weight_bytes`` (what ``W``
  reads), which ``W`` frees; without ``weight_bytes``, everything stays until ``W``.

>>> from schedules import one_f_one_b
>>> costs = Costs(forward=1.0, input_grad=1.0, weight_grad=0.5, comm=0.25)
>>> table = costs.resolve(one_f_one_b(stages=2, microbatches=2))
>>> [table.duration(Op.F, 0, 0), table.duration(Op.B, 0, 0), table.duration(Op.I, 1, 1)]
[1.0, 1.5, 1.0]
>>> table.hop(producer_chunk=0, consumer_chunk=1, microbatch=0)
0.25
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union, cast

from schedules.dependencies import crossings
from schedules.recompute import CHECKPOINT_MODES, CheckpointMode, recomputed
from schedules._speed import OP_F, OP_W
from schedules.action import Op, Schedule
from schedules.cost_values import check_number, checked_value

Value = Union[float, Sequence[float]]
"""One number for every chunk (or stage), or one number per chunk (or stage)."""

HopTime = Callable[[int, int, float], float]
"""``(source stage, destination stage, payload bytes) -> time`` of one transfer."""

Comm = Union[float, Sequence[Sequence[float]], HopTime]
"""Hop time: one number per transfer, a ``[source][destination]`` stage matrix, or a HopTime."""



@dataclass(frozen=True)
class Link:
    """A hop model: ``latency + payload bytes / bandwidth`` for every transfer.

    Attributes:
        latency: time per transfer, whatever its size.
        bandwidth: bytes per time unit; ``math.inf`` makes payloads free.

    >>> Link(latency=1e-5, bandwidth=1e9)(0, 1, 2e6)
    0.00201
    """

    latency: float = 0.0
    bandwidth: float = math.inf

    def __post_init__(self) -> None:
        check_number("Link latency", self.latency)
        if not (isinstance(self.bandwidth, numbers.Real) and self.bandwidth > 0):
            raise ValueError(f"Link bandwidth: expected a number > 0, got {self.bandwidth!r}")

    def __call__(self, source: int, destination: int, nbytes: float) -> float:
        """The time to move ``nbytes`` from stage ``source`` to stage ``destination``."""
        return float(self.latency + nbytes / self.bandwidth)


@dataclass(frozen=True)
class Costs:
    """Times and bytes of one micro-batch on each model chunk, plus hops and recomputation.

    Every ``Value`` is one number or a sequence with one number per chunk (or per
    stage, with ``per="stage"``). Times are in any unit (seconds, or multiples of a
    forward); bytes in bytes. All must be finite and >= 0.

    Attributes:
        forward: ``F`` time.
        backward: full backward ``B`` time (input and weight gradients), without
            recomputation; None: ``input_grad + weight_grad`` if both are given,
            else ``2 x forward``.
        input_grad: ``I`` time; None: ``backward - weight_grad`` if that is given,
            else ``backward / 2``.
        weight_grad: ``W`` time; None: ``backward - I``.
        comm: time of one transfer between stages (an activation forward, or a
            gradient back): a number, a ``[source][destination]`` matrix over stages,
            or a callable ``(source, destination, nbytes) -> time`` such as ``Link``,
            given the payload ``input_bytes`` of the receiving (forward) or sending
            (backward) chunk, scaled per micro-batch.
        per: ``"chunk"``: sequences index model chunks and scalars are per chunk;
            ``"stage"``: they index stages and each stage's value is shared evenly
            among the chunks it holds (``simulate``'s keywords).
        microbatch_scale: one factor per micro-batch (its size relative to the one
            the costs were measured at) multiplying its times, payloads and bytes;
            empty means 1 for all.
        recompute: which micro-batches' forwards are recomputed before their
            backward: a checkpoint mode (``"never"``, ``"always"``, or
            ``"except_last"``: all but the last micro-batch) or one bool per
            micro-batch.
        activation_bytes: bytes a chunk's forward saves for its backward, per
            micro-batch, its input included (as ``saved_tensors_hooks`` counts
            them); None: no memory prediction.
        input_bytes: bytes of a chunk's input per micro-batch: what a recomputed
            micro-batch keeps until its backward, and the payload of its hops
            (the activation into the chunk, the gradient back out of it).
        fixed_bytes: bytes a chunk holds throughout (parameters, gradients,
            optimizer state).
        weight_bytes: bytes a chunk keeps per micro-batch from the end of its ``I``
            to the end of its ``W`` (the saved tensors the weight gradients read and
            the gradients ``I`` captured for them; these can make it more than
            ``activation_bytes``); None: all of ``activation_bytes``.
        exchange: of a chunk's forward, the time it waits on expert all-to-alls (part of
            ``forward``, as its backward, ``B`` or ``I``, waits as long on the reversed
            exchanges): what an overlapped pair (``schedules.pairs``) can hide under the
            other action's computation. 0: no exchange.
    """

    forward: Value = 1.0
    backward: Value | None = None
    input_grad: Value | None = None
    weight_grad: Value | None = None
    comm: Comm = 0.0
    per: Literal["chunk", "stage"] = "chunk"
    microbatch_scale: Sequence[float] = ()
    recompute: CheckpointMode | Sequence[bool] = "never"
    activation_bytes: Value | None = None
    input_bytes: Value = 0.0
    fixed_bytes: Value = 0.0
    weight_bytes: Value | None = None
    exchange: Value = 0.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "input_grad", "weight_grad",
                     "activation_bytes", "input_bytes", "fixed_bytes", "weight_bytes",
                     "exchange"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, checked_value(name, value))
        object.__setattr__(self, "comm", _checked_comm(self.comm))
        if self.per not in ("chunk", "stage"):
            raise ValueError(f"per: expected 'chunk' or 'stage', got {self.per!r}")
        scale = checked_value("microbatch_scale", tuple(self.microbatch_scale))
        object.__setattr__(self, "microbatch_scale", scale)
        if isinstance(self.recompute, str):
            if self.recompute not in CHECKPOINT_MODES:
                raise ValueError(
                    f"recompute: expected one of {', '.join(CHECKPOINT_MODES)} or one bool "
                    f"per micro-batch, got {self.recompute!r}"
                )
        else:
            object.__setattr__(self, "recompute", tuple(bool(r) for r in self.recompute))

    @classmethod
    def from_stages(
        cls,
        forward: Value = 1.0,
        backward: Value = 2.0,
        weight: Value | None = None,
        comm: Comm = 0.0,
        **more: Any,
    ) -> Costs:
        """The costs ``simulate``'s keywords describe: whole-stage times.

        Args:
            forward: ``F`` per stage (one number or one per stage).
            backward: the full backward ``B`` when ``weight`` is None (split as
                ``I = W = B / 2``); the input gradient ``I`` when it is given.
            weight: the weight gradient ``W``, or None; then ``B = I + W``.
            comm: hop time (see ``Costs.comm``).
            **more: any other ``Costs`` field (bytes, ``recompute``, ...).

        Returns:
            ``Costs`` with ``per="stage"``.

        >>> from schedules import one_f_one_b
        >>> Costs.from_stages(forward=1, backward=4, weight=3).resolve(
        ...     one_f_one_b(2, 2)).duration(Op.B, 0, 0)
        7.0
        """
        if weight is None:
            return cls(forward=forward, backward=backward, comm=comm, per="stage", **more)
        return cls(forward=forward, input_grad=backward, weight_grad=weight, comm=comm,
                   per="stage", **more)

    def resolve(self, schedule: Schedule) -> ResolvedCosts:
        """Check these costs against ``schedule`` and spell them out per chunk and micro-batch.

        Raises:
            ValueError: a sequence of the wrong length (expected vs given), a
                derived time below zero, or a hop time that is not finite and >= 0.
        """
        return _resolve(self, schedule)


@dataclass(frozen=True)
class ResolvedCosts:
    """``Costs`` spelled out for one schedule (built by ``Costs.resolve``).

    Attributes:
        compute: ``compute[chunk][op]``, one micro-batch's time, unscaled, without
            recomputation.
        scale: one factor per micro-batch.
        recomputed: one bool per micro-batch.
        hops: ``hops[consumer chunk][producer chunk]``: per micro-batch, the time of
            the transfer between them; only pairs on different stages are present.
        activation_bytes: per chunk, or None when there is no memory prediction.
        input_bytes: per chunk.
        fixed_bytes: per stage, the sum over its chunks.
        weight_bytes: per chunk, what stays from ``I`` to ``W`` (None with no memory
            prediction); ``activation_bytes`` where the costs gave none.
        exchange: per chunk, the expert all-to-all time within its forward (and as much
            within its backward), unscaled.
    """

    compute: tuple[dict[Op, float], ...]
    scale: tuple[float, ...]
    recomputed: tuple[bool, ...]
    hops: tuple[dict[int, tuple[float, ...]], ...]
    activation_bytes: tuple[float, ...] | None
    input_bytes: tuple[float, ...]
    fixed_bytes: tuple[float, ...]
    weight_bytes: tuple[float, ...] | None = None
    exchange: tuple[float, ...] = ()

    def duration(self, op: Op, microbatch: int, chunk: int) -> float:
        """The time of one action, recomputation and micro-batch scale included."""
        time = self.compute[chunk][op]
        if op is not OP_F and op is not OP_W and self.recomputed[microbatch]:
            time += self.compute[chunk][OP_F]
        return time * self.scale[microbatch]

    def hop(self, producer_chunk: int, consumer_chunk: int, microbatch: int) -> float:
        """The time a result takes from producer to consumer chunk; 0 on one stage."""
        times = self.hops[consumer_chunk].get(producer_chunk)
        return 0.0 if times is None else times[microbatch]


def _resolve(costs: Costs, schedule: Schedule) -> ResolvedCosts:
    chunks, micro = schedule.chunks, schedule.microbatches
    per_chunk = _spreader(costs, schedule)
    forward = per_chunk("forward", costs.forward)
    full = None if costs.backward is None else per_chunk("backward", costs.backward)
    given_i = None if costs.input_grad is None else per_chunk("input_grad", costs.input_grad)
    given_w = None if costs.weight_grad is None else per_chunk("weight_grad", costs.weight_grad)
    compute = []
    for c in range(chunks):
        b = full[c] if full is not None else (
            given_i[c] + given_w[c] if given_i is not None and given_w is not None
            else 2 * forward[c])
        i = given_i[c] if given_i is not None else (
            b - given_w[c] if given_w is not None else b / 2)
        w = given_w[c] if given_w is not None else b - i
        for name, value in (("input_grad", i), ("weight_grad", w)):
            if value < 0:
                raise ValueError(
                    f"{name} of chunk {c}: derived from backward={b} it would be {value}; "
                    f"expected input_grad and weight_grad <= backward"
                )
        compute.append({Op.F: forward[c], Op.B: b, Op.I: i, Op.W: w})
    scale = costs.microbatch_scale or (1.0,) * micro
    if len(scale) != micro:
        raise ValueError(f"microbatch_scale: expected {micro} numbers (one per micro-batch), "
                         f"got {len(scale)}")
    recomputed = _recomputed(costs.recompute, micro)
    payload = per_chunk("input_bytes", costs.input_bytes)
    fixed_chunk = per_chunk("fixed_bytes", costs.fixed_bytes)
    saved = None if costs.activation_bytes is None else per_chunk(
        "activation_bytes", costs.activation_bytes)
    kept_for_w = saved if saved is None or costs.weight_bytes is None else per_chunk(
        "weight_bytes", costs.weight_bytes)
    return ResolvedCosts(
        compute=tuple(compute),
        scale=tuple(scale),
        recomputed=recomputed,
        hops=_hops(costs.comm, schedule, payload, tuple(scale)),
        activation_bytes=saved,
        input_bytes=payload,
        fixed_bytes=tuple(sum(fixed_chunk[c] for c in owned) for owned in schedule.chunks_of_stage),
        weight_bytes=kept_for_w,
        exchange=per_chunk("exchange", costs.exchange),
    )


def _spreader(costs: Costs, schedule: Schedule) -> Callable[[str, object], tuple[float, ...]]:
    """A function turning a field's value into one number per chunk."""
    by_stage = costs.per == "stage"
    count = schedule.stages if by_stage else schedule.chunks
    unit = "stage" if by_stage else "chunk"

    def spread(name: str, value: object) -> tuple[float, ...]:
        # Costs.__post_init__ made every value a float or a tuple of floats.
        values = (value,) * count if isinstance(value, float) else cast(tuple[float, ...], value)
        if len(values) != count:
            raise ValueError(f"{name} cost: expected one number or {count} per-{unit} numbers, "
                             f"got {len(values)}")
        if not by_stage:
            return values
        return tuple(values[owner] / len(schedule.chunks_of_stage[owner])
                     for owner in schedule.placement)

    return spread


def _recomputed(recompute: CheckpointMode | Sequence[bool], micro: int) -> tuple[bool, ...]:
    if isinstance(recompute, str):
        return recomputed(recompute, micro)
    flags = tuple(recompute)
    if len(flags) != micro:
        raise ValueError(f"recompute: expected {micro} bools (one per micro-batch), "
                         f"got {len(flags)}")
    return flags


def _hops(
    comm: Comm, schedule: Schedule, payload: tuple[float, ...], scale: tuple[float, ...]
) -> tuple[dict[int, tuple[float, ...]], ...]:
    """Per consumer chunk, per cross-stage producer chunk, the hop time per micro-batch."""
    placement = schedule.placement
    if not callable(comm) and not isinstance(comm, float):
        shape = [len(row) for row in comm]
        if shape != [schedule.stages] * schedule.stages:
            raise ValueError(f"comm matrix: expected {schedule.stages} rows of {schedule.stages} "
                             f"(source x destination stage), got rows of {shape}")
    hops: list[dict[int, tuple[float, ...]]] = [{} for _ in range(schedule.chunks)]
    for chunk, source, destination in crossings(placement):
        # The activation goes on to the next chunk; its gradient comes back, the same size
        # (the next chunk's input).
        nbytes = payload[chunk + 1]
        hops[chunk][chunk + 1] = _per_microbatch(comm, destination, source, nbytes, scale)
        hops[chunk + 1][chunk] = _per_microbatch(comm, source, destination, nbytes, scale)
    return tuple(hops)


def _per_microbatch(comm: Comm, source: int, destination: int, nbytes: float,
                    scale: tuple[float, ...]) -> tuple[float, ...]:
    by_factor = {factor: hop_time(comm, source, destination, nbytes * factor)
                 for factor in set(scale)}
    if len(by_factor) == 1:  # one size for all: a tuple at C speed (10^5 hops at P=64)
        return tuple(by_factor.values()) * len(scale)
    return tuple(by_factor[factor] for factor in scale)


def hop_time(comm: Comm, source: int, destination: int, nbytes: float) -> float:
    """Seconds of one transfer of ``nbytes`` from stage ``source`` to ``destination``.

    Raises:
        ValueError: a time that is not finite and >= 0.
    """
    if isinstance(comm, (int, float)):
        return check_number("comm", comm)
    if callable(comm):
        time = comm(source, destination, nbytes)
        name = f"comm({source}, {destination}, {nbytes:g})"
    else:
        time, name = comm[source][destination], f"comm[{source}][{destination}]"
    return check_number(name, time)


def _checked_comm(comm: Comm) -> Comm:
    if callable(comm):
        return comm
    if isinstance(comm, (float, numbers.Real)):
        return check_number("comm", comm)
    rows = tuple(tuple(check_number(f"comm[{s}][{d}]", t) for d, t in enumerate(row))
                 for s, row in enumerate(comm))
    return rows

