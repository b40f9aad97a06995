"""Choose the cut: layers per stage, uniform, by parameters, or by time (exact, memory-capped)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from fractions import Fraction
from itertools import accumulate
from typing import Literal, cast

from partitioners.measure.cost import LayerCost, Profile
from partitioners.cut.feasibility import Problem
from partitioners.cut.memory import held_microbatches, memory_cap, stage_memory
from partitioners.errors import MemoryLimitError
from partitioners.cut.minmax import NoCutFits, smallest_memory_cap, solve
from partitioners.measure.sizes import format_bytes
from schedules import Schedule

By = Literal["time", "params", "uniform"]
_Costs = Sequence[LayerCost]
BY: tuple[str, ...] = ("time", "params", "uniform")


def balance(
    costs: Sequence[LayerCost] | Sequence[float],
    stages: int,
    by: By = "time",
    memory_limit: float | None = None,
    schedule: str | Schedule = "1f1b",
    microbatches: int | None = None,
    bandwidth: float | None = None,
    last_stage_extra: float | None = None,
) -> list[int]:
    """Layers per stage: every stage non-empty, summing to ``len(costs)``.

    ``by="time"`` minimises the slowest stage's forward+backward time exactly, and
    among such cuts takes one whose second-slowest stage is smallest. ``"params"``
    does the same with parameter bytes; ``"uniform"`` spreads layers evenly, earlier
    stages taking the remainder.

    >>> balance([3.0, 1.0, 2.0, 2.0], stages=2)
    [2, 2]

    Args:
        costs: per layer, a LayerCost (from ``profile``) or a plain number, the
            layer's weight (then ``by`` is ``"time"`` or ``"uniform"``).
        stages: number of stages, between 1 and the number of layers.
        by: what to balance.
        memory_limit: bytes per stage. A stage's memory is its parameters and their
            gradients (``2 * param_bytes``) plus its ``saved_bytes`` times the
            micro-batches it holds at once under ``schedule`` (1F1B: ``P - s``,
            GPipe: M). The fastest cut that fits every stage is returned.
        schedule: the schedule name or Schedule the memory limit assumes.
        microbatches: micro-batches per step for the memory limit; None means
            ``stages`` (1F1B's steady state).
        bandwidth: bytes per second between stages. If given, each stage but the
            last also pays ``activation_bytes / bandwidth`` of its last layer, so
            cuts prefer small activations.
        last_stage_extra: seconds the last stage pays on top of its layers, e.g.
            the loss's forward and backward, so that a big output layer plus its
            loss is not underestimated. None means the loss time of a Profile
            measured with a ``loss_fn`` (``costs.loss.time``), else 0. Only
            ``by="time"`` weighs it.

    Returns:
        The number of layers in each stage, in order.

    Raises:
        ValueError: ``stages`` outside ``1..len(costs)``, no costs, a negative or
            non-finite cost or ``last_stage_extra``, an unknown ``by``, options
            that need LayerCost given plain numbers, a ``last_stage_extra`` with a
            ``by`` other than ``"time"``.
        MemoryLimitError: a memory limit no cut meets (a ValueError; its
            ``smallest_limit`` and message give the smallest that would).
    """
    layers = len(costs)
    check_stages(layers, stages)
    if by not in BY:
        raise ValueError(f"by must be one of {', '.join(BY)}; got {by!r}")
    measured = _measured(costs)
    if isinstance(memory_limit, float) and memory_limit == math.inf:
        memory_limit = None
    _check_options(measured, by, memory_limit, bandwidth)
    extra = _last_stage_extra(costs, by, last_stage_extra)
    if by == "uniform":
        sizes = uniform(layers, stages)
        if memory_limit is not None:
            _check_uniform_fits(cast(_Costs, costs), sizes, memory_limit, schedule, microbatches)
        return sizes
    if not measured:
        plain = _charged_last(cast(Sequence[float], costs), extra)
        return solve(Problem(_exact_integers(plain, [])[0], stages))
    layer_costs = cast(_Costs, costs)
    weights = _charged_last(
        [cost.time if by == "time" else cost.param_bytes for cost in layer_costs], extra
    )
    send = []
    if bandwidth is not None:
        send = [Fraction(cost.activation_bytes) / _fraction(bandwidth) for cost in layer_costs]
    prefix, send_scaled = _exact_integers(weights, send)
    if memory_limit is None:
        return solve(Problem(prefix, stages, send_scaled))
    held = held_microbatches(schedule, stages, microbatches)
    cap, scale = memory_cap(layer_costs, held, memory_limit)
    try:
        return solve(Problem(prefix, stages, send_scaled, cap))
    except NoCutFits:
        smallest = _smallest_limit(Problem(prefix, stages, memory=cap), scale)
        raise MemoryLimitError(
            f"no cut of {layers} layers into {stages} stages fits memory_limit="
            f"{format_bytes(memory_limit, exact=True)} per stage under "
            f"{_schedule_name(schedule)} with {_held_text(held)}; the smallest limit "
            f"that fits is {format_bytes(smallest, exact=True)}", smallest
        ) from None


def _last_stage_extra(
    costs: Sequence[LayerCost] | Sequence[float], by: str, given: float | None
) -> float:
    """The seconds to add to the last stage: ``given``, or a Profile's loss time."""
    if given is None:
        loss = costs.loss if isinstance(costs, Profile) else None
        return loss.time if loss is not None and by == "time" else 0.0
    if isinstance(given, bool) or not isinstance(given, numbers.Real) or not (
        math.isfinite(given) and given >= 0
    ):
        raise ValueError(f"last_stage_extra must be finite seconds >= 0, got {given!r}")
    if by != "time" and given != 0:
        raise ValueError(f"last_stage_extra is seconds, so it needs by='time', got by={by!r}")
    return given


def _charged_last(weights: Sequence[float], extra: float) -> Sequence[float | Fraction]:
    """``weights`` with ``extra`` on the last layer, which is always in the last stage.

    Adding it to that layer is exactly adding it to the last stage: no cut moves
    the last layer elsewhere, and no send cost is charged after it.
    """
    if not extra:
        return weights
    exact = [_fraction(weight) for weight in weights]
    exact[-1] += _fraction(extra)
    return exact


def _smallest_limit(problem: Problem, scale: int) -> int:
    """The smallest memory limit in bytes that some cut meets."""
    cap = problem.memory
    if cap is None:
        return 0
    ends = list(accumulate(uniform(problem.layers, problem.stages), initial=0))
    fits = max(cap.stage(ends[s], ends[s + 1], s) for s in range(problem.stages))
    return math.ceil(Fraction(smallest_memory_cap(problem, fits), scale))


def check_stages(layers: int, stages: int) -> None:
    """Raise ValueError unless ``1 <= stages <= layers``."""
    if isinstance(stages, bool) or not isinstance(stages, int):
        raise ValueError(f"stages must be an int >= 1, got {stages!r}")
    if layers < 1:
        raise ValueError("expected at least one layer to balance, got none (an empty model?)")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got stages={stages}")
    if stages > layers:
        raise ValueError(
            f"cannot cut {layers} layers into {stages} non-empty stages: expected "
            f"stages <= {layers}"
        )


def uniform(layers: int, stages: int) -> list[int]:
    """Layers per stage, as even as possible, earlier stages taking the remainder."""
    check_stages(layers, stages)
    base, extra = divmod(layers, stages)
    return [base + (1 if stage < extra else 0) for stage in range(stages)]


def _measured(costs: Sequence[LayerCost] | Sequence[float]) -> bool:
    """True for LayerCosts, False for plain weights; raise on a mix or a bad number."""
    kinds = {isinstance(cost, LayerCost) for cost in costs}
    if kinds == {True}:
        return True
    if kinds == {True, False}:
        raise ValueError("costs must be all LayerCost or all plain numbers, got a mix")
    for index, cost in enumerate(costs):
        if isinstance(cost, bool) or not isinstance(cost, numbers.Real):
            raise ValueError(f"cost {index}: expected a number or a LayerCost, got {cost!r}")
        if not math.isfinite(cost) or cost < 0:
            raise ValueError(f"cost {index}: expected a finite weight >= 0, got {cost}")
    return False


def _check_options(
    measured: bool, by: str, memory_limit: float | None, bandwidth: float | None
) -> None:
    if not measured:
        needs = [
            name
            for name, given in (
                ("by='params'", by == "params"),
                ("memory_limit", memory_limit is not None),
                ("bandwidth", bandwidth is not None),
            )
            if given
        ]
        if needs:
            raise ValueError(
                f"{needs[0]} needs LayerCost entries (from profile), got plain numbers"
            )
    if memory_limit is not None and (
        isinstance(memory_limit, bool) or not isinstance(memory_limit, numbers.Real)
        or math.isnan(memory_limit) or memory_limit < 0
    ):
        raise ValueError(f"memory_limit must be a number of bytes >= 0, got {memory_limit!r}")
    if bandwidth is not None:
        if by != "time":
            raise ValueError(f"bandwidth adds send time, so it needs by='time', got by={by!r}")
        if (
            isinstance(bandwidth, bool) or not isinstance(bandwidth, numbers.Real)
            or not math.isfinite(bandwidth) or bandwidth <= 0
        ):
            raise ValueError(f"bandwidth must be bytes per second > 0, got {bandwidth!r}")


def _check_uniform_fits(
    costs: Sequence[LayerCost],
    sizes: list[int],
    memory_limit: float,
    schedule: str | Schedule,
    microbatches: int | None,
) -> None:
    held = held_microbatches(schedule, len(sizes), microbatches)
    need = max(stage_memory(costs, sizes, held))
    if need > memory_limit:
        raise ValueError(
            f"the uniform cut {sizes} needs {format_bytes(need, exact=True)} per stage "
            f"under {_schedule_name(schedule)}, over memory_limit="
            f"{format_bytes(memory_limit, exact=True)}; by='time' finds the fastest cut that fits"
        )


def _exact_integers(
    weights: Sequence[float | Fraction], send: Sequence[Fraction]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Prefix sums of ``weights`` and the ``send`` costs, as integers in one common unit."""
    exact = [_fraction(weight) for weight in weights]
    scale = math.lcm(*(value.denominator for value in [*exact, *send]))
    prefix = tuple(accumulate((_scaled(value, scale) for value in exact), initial=0))
    return prefix, tuple(_scaled(value, scale) for value in send)


def _fraction(value: float | Fraction) -> Fraction:
    return Fraction(value) if isinstance(value, numbers.Rational) else Fraction(float(value))


def _scaled(value: Fraction, scale: int) -> int:
    return value.numerator * (scale // value.denominator)


def _schedule_name(schedule: str | Schedule) -> str:
    return schedule.name if isinstance(schedule, Schedule) else str(schedule)


def _held_text(held: Sequence[float]) -> str:
    counts = [f"{h:g}" for h in held]
    if len(counts) > 6:
        counts = counts[:3] + ["..."] + counts[-2:]
    return f"micro-batches held per stage ({', '.join(counts)})"
