"""Stage memory under a schedule: parameters with their gradients, plus held saved activations.

With data-parallel replicas (``DataParallelism``) a stage's fixed bytes change shape.
Whole copies (``"replicate"``) hold what one stage alone does. FSDP2 shards
(``"fsdp"``, as ``pipeline.runtime.data_parallel.FullyShard`` runs them) hold, between
steps, 1/replicas of the parameters, of their gradients and of the optimizer's state;
within a step they also hold the whole parameters they gathered (``gathered_bytes``) and
the whole gradients, which accumulate unsharded until the step's one reduce-scatter.
So a stage holds, at its peak, ``(parameters + gradients + optimizer) / replicas +
gradients + gathered`` (``sharded_fixed_bytes``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import accumulate

from partitioners.measure.cost import LayerCost, check_ties
from partitioners.cut.feasibility import Copies, MemoryCap
from schedules import Link, Schedule, get_schedule, simulate


@dataclass(frozen=True)
class DataParallelism:
    """How each pipeline stage's data-parallel replicas hold it (a mesh's ``"dp"`` dimension).

    Attributes:
        replicas: ranks holding each stage; 1: no data parallelism.
        sharded: FSDP2 (``Pipe(data_parallel="fsdp")``): parameters, gradients and
            optimizer state 1/replicas each between steps, each FSDP shard group (a layer)
            all-gathered once per step and its gradients reduce-scattered once. False:
            whole copies whose gradients are all-reduced once per step (``"replicate"``).
        reshard_after_forward: with ``sharded``, a shard group's gathered parameters are freed
            after each forward (and, unless the schedule splits backwards, each backward)
            and gathered again before the next: less memory, more all-gathers.
        link: the hop between two replicas that prices the collectives (a ring of
            ``replicas`` such hops); None: the planner's ``hop``.

    Raises:
        ValueError: ``replicas`` not an int >= 1, or ``reshard_after_forward`` without
            ``sharded`` (whole copies gather nothing).
    """

    replicas: int = 1
    sharded: bool = False
    reshard_after_forward: bool = False
    link: Link | None = None

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, numbers.Integral) \
                or self.replicas < 1:
            raise ValueError(f"DataParallelism replicas: expected an int >= 1, got "
                             f"{self.replicas!r}")
        if self.reshard_after_forward and not self.sharded:
            raise ValueError("DataParallelism: reshard_after_forward=True applies to sharded "
                             "replicas only (data_parallel='fsdp'), got sharded=False")
        if self.link is not None and not isinstance(self.link, Link):
            raise TypeError(f"DataParallelism link: expected a schedules.Link or None, got "
                            f"{self.link!r}")

    @property
    def active(self) -> bool:
        """Whether there are replicas at all (more than one)."""
        return self.replicas > 1


NO_REPLICAS = DataParallelism()


def gathered_bytes(shard_groups: Sequence[float], reshard_after_forward: bool,
                   split_backward: bool) -> float:
    """Bytes of whole parameters a sharded stage holds gathered at once within a step.

    Every shard group stays gathered from its first forward to the step's reduce-scatter
    by default. With ``reshard_after_forward`` a shard group is gathered around each forward
    and backward only, so at once the largest shard group; but after a split backward's I
    the shard groups stay gathered for the W (and until the chunk's next forward): the whole stage again.

    Args:
        shard_groups: bytes of each FSDP shard group's whole parameters on the stage.
        reshard_after_forward: whether gathered parameters are freed after each forward.
        split_backward: whether the schedule splits backwards into I and W.
    """
    if not shard_groups:
        return 0.0
    if reshard_after_forward and not split_backward:
        return float(max(shard_groups))
    return float(sum(shard_groups))


def sharded_fixed_bytes(parameters: float, optimizer_factor: float, shard_groups: Sequence[float],
                        data_parallel: DataParallelism, split_backward: bool) -> float:
    """The fixed bytes of one stage with ``parameters`` bytes, at its peak within a step.

    Without replicas, or with whole copies: ``(2 + optimizer_factor) x parameters``.
    Sharded: ``(2 + optimizer_factor) x parameters / replicas`` between steps, plus the
    unsharded gradients (``parameters``) and the gathered parameters
    (``gathered_bytes(shard_groups, ...)``) within one.

    >>> sharded_fixed_bytes(400.0, 2.0, [100.0] * 4, DataParallelism(4, sharded=True), False)
    1200.0
    >>> sharded_fixed_bytes(400.0, 2.0, [100.0] * 4,
    ...                     DataParallelism(4, sharded=True, reshard_after_forward=True), False)
    900.0
    """
    whole = (2 + optimizer_factor) * parameters
    if not (data_parallel.sharded and data_parallel.active):
        return whole
    return (whole / data_parallel.replicas + parameters
            + gathered_bytes(shard_groups, data_parallel.reshard_after_forward, split_backward))


def held_microbatches(
    schedule: str | Schedule, stages: int, microbatches: int | None = None
) -> tuple[float, ...]:
    """Per stage, the most micro-batches whose saved activations it holds at once.

    Read from ``simulate(schedule).peak_activations``: GPipe holds all M, 1F1B
    ``min(P - s, M)`` on stage s.

    Args:
        schedule: a schedule name (``"1f1b"``, ``"gpipe"``, ...) or a Schedule.
        stages: number of stages; must match a given Schedule.
        microbatches: micro-batches per step; None means ``stages`` (1F1B's full
            steady state). Ignored for a given Schedule.

    Raises:
        ValueError: an unknown schedule name, bad counts, or a schedule that does
            not hold one model chunk per stage.
    """
    if isinstance(schedule, Schedule):
        timetable = schedule
        if timetable.stages != stages:
            raise ValueError(
                f"schedule has {timetable.stages} stages, expected stages={stages}"
            )
    else:
        timetable = get_schedule(schedule, stages, stages if microbatches is None else microbatches)
    if timetable.chunks != timetable.stages:
        raise ValueError(
            f"balance cuts one model chunk per stage, but schedule {timetable.name!r} places "
            f"{timetable.chunks} chunks on {timetable.stages} stages"
        )
    return simulate(timetable).peak_activations


def stage_memory(
    costs: Sequence[LayerCost], sizes: Sequence[int], held: Sequence[float]
) -> list[float]:
    """Bytes per stage of the cut ``sizes``: ``2 * param_bytes + held * saved_bytes``.

    A stage also holds a copy of each earlier stage's parameters its layers use
    (``LayerCost.tied``: a head tied to the embedding).
    """
    check_ties(costs)
    memory, start = [], 0
    for stage, size in enumerate(sizes):
        layers = costs[start : start + size]
        copies: dict[int, int] = {}
        for cost in layers:
            for origin, nbytes in cost.tied:
                if origin < start:
                    copies[origin] = max(copies.get(origin, 0), nbytes)
        fixed = sum(2 * cost.param_bytes for cost in layers) + 2 * sum(copies.values())
        saved = sum(cost.saved_bytes for cost in layers)
        memory.append(fixed + held[stage] * saved)
        start += size
    return memory


def memory_cap(
    costs: Sequence[LayerCost], held: Sequence[float], limit: float
) -> tuple[MemoryCap, int]:
    """The exact integer cap for ``feasibility``, and the scale its units carry.

    Held counts can be fractions of a micro-batch (a chunk of a stage with several);
    every quantity is multiplied by the common denominator so that all stay integers.
    """
    ratios = [Fraction(h).limit_denominator(1000) for h in held]
    scale = math.lcm(*(ratio.denominator for ratio in ratios))
    cap = MemoryCap(
        fixed=tuple(accumulate((2 * scale * cost.param_bytes for cost in costs), initial=0)),
        saved=tuple(accumulate((cost.saved_bytes for cost in costs), initial=0)),
        held=tuple(int(ratio * scale) for ratio in ratios),
        limit=math.floor(Fraction(limit) * scale),
        copies=tied_copies(costs, lambda nbytes: 2 * scale * nbytes),
    )
    return cap, scale


def tied_copies(
    costs: Sequence[LayerCost], charge: Callable[[int], int]
) -> Copies:
    """``MemoryCap.copies`` of ``costs``: per layer whose parameters later layers use, those
    layers and ``charge(bytes)`` of what each uses."""
    check_ties(costs)
    users: dict[int, list[tuple[int, int]]] = {}
    for layer, cost in enumerate(costs):
        for origin, nbytes in cost.tied:
            users.setdefault(origin, []).append((layer, charge(nbytes)))
    return tuple((origin, tuple(layer for layer, _ in users[origin]),
                  tuple(used for _, used in users[origin])) for origin in sorted(users))
