"""What the planner searches: schedule variants, micro-batch counts, and the costs behind them."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import lru_cache
from typing import Any, Union

from partitioners.measure.cost import LayerCost
from schedules import Schedule, schedule_info, schedule_names
from schedules.recompute import CHECKPOINT_MODES

CostSource = Union[Mapping[int, Sequence[LayerCost]], Callable[[int], Sequence[LayerCost]]]
"""Per-layer costs by micro-batch rows: a mapping ``rows -> costs``, or ``at(rows) -> costs``."""

Options = tuple[tuple[str, Any], ...]
"""A schedule's options as sorted ``(name, value)`` pairs, so that they hash."""


def default_microbatch_counts(stages: int, batch: int) -> tuple[int, ...]:
    """Powers of two and multiples of ``stages`` up to ``min(batch, 4 x stages)``.

    >>> default_microbatch_counts(4, 64)
    (1, 2, 4, 8, 12, 16)
    """
    top = min(batch, 4 * stages)
    powers = {2**k for k in range(top.bit_length()) if 2**k <= top}
    return tuple(sorted(powers | set(range(stages, top + 1, stages))))


def microbatch_counts(
    costs: CostSource, stages: int, batch: int, given: Sequence[int] | None
) -> tuple[int, ...]:
    """The micro-batch counts to search, checked against ``batch`` and a mapping's sizes.

    Raises:
        ValueError: a count outside ``1..batch``, or (for a mapping of costs) one
            whose largest micro-batch, ``ceil(batch / M)`` rows, has no costs; or
            no count at all.
    """
    if given is None:
        if isinstance(costs, Mapping):
            counts = tuple(m for m in range(1, batch + 1) if -(-batch // m) in costs)
        else:
            counts = default_microbatch_counts(stages, batch)
    else:
        counts = tuple(sorted(set(given)))
        for m in counts:
            if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= batch:
                raise ValueError(f"microbatch_counts: expected ints in 1..{batch} (the batch's "
                                 f"rows), got {m!r}")
            if isinstance(costs, Mapping) and -(-batch // m) not in costs:
                raise ValueError(
                    f"microbatch_counts: M={m} splits {batch} rows into micro-batches of up to "
                    f"{-(-batch // m)} rows, but costs are given for {sorted(costs)} rows only")
    if not counts:
        sizes = sorted(costs) if isinstance(costs, Mapping) else []
        raise ValueError(f"no micro-batch count splits {batch} rows into the sizes the costs "
                         f"were measured at ({sizes}); expected a size ceil({batch} / M)")
    return counts


def check_names(names: Sequence[str] | None) -> tuple[str, ...]:
    """Registered schedule names (all when None); ValueError names an unknown one."""
    if names is None:
        return schedule_names()
    if isinstance(names, str):
        names = [names]
    found = tuple(dict.fromkeys(schedule_info(name).name for name in names))
    if not found:
        raise ValueError("schedules: expected at least one schedule name, got none")
    return found


def check_checkpoints(modes: Sequence[str]) -> tuple[str, ...]:
    """The checkpoint modes, each one of ``never``, ``except_last``, ``always``."""
    if isinstance(modes, str):
        modes = [modes]
    found = tuple(dict.fromkeys(modes))
    bad = [mode for mode in found if mode not in CHECKPOINT_MODES]
    if bad or not found:
        raise ValueError(f"checkpoints: expected some of {', '.join(CHECKPOINT_MODES)}, "
                         f"got {list(modes)}")
    return found


def check_limit(memory_limit: float | None) -> float | None:
    """``memory_limit`` as a float, or None (also for infinity)."""
    if memory_limit is None:
        return None
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, numbers.Real) or (
        math.isnan(memory_limit) or memory_limit < 0
    ):
        raise ValueError(f"memory_limit: expected bytes per stage >= 0, got {memory_limit!r}")
    return None if math.isinf(memory_limit) else float(memory_limit)


def variants(name: str, stages: int, microbatches: int, exchanges: bool = False
             ) -> Iterator[Options]:
    """The options searched for schedule ``name`` at ``stages`` and ``microbatches``.

    Interleaved 1F1B: two chunks per stage. ``zb``: up to three ``max_inflight``
    points strictly between ZB-H1 (``P``) and ZB-H2 (``2P-1``), one per distinct
    number of extra micro-batches ``e = min(k - P, M - P)`` that is neither
    schedule (``1 <= e < min(P - 1, M - P)``). DualPipeV: with ``exchanges`` (the
    units spend time on expert all-to-alls) its overlapped pairs too. Others: their
    defaults. Nothing when ``microbatches`` is below the schedule's minimum.
    """
    info = schedule_info(name)
    least = info.min_microbatches(stages) if info.min_microbatches else 1
    if microbatches < least:
        return
    if name == "interleaved-1f1b":
        yield (("chunks_per_stage", 2),)
    elif name == "zb":
        seen = set()
        for k in (stages + 1, (3 * stages - 1) // 2, 2 * stages - 2):
            extra = min(k - stages, microbatches - stages)
            if 1 <= extra < min(stages - 1, microbatches - stages) and extra not in seen:
                seen.add(extra)
                yield (("max_inflight", k),)
    else:
        yield ()
        if name == "dualpipe-v" and exchanges:
            yield (("overlap", True),)


@lru_cache(maxsize=512)
def build(name: str, stages: int, microbatches: int, options: Options) -> Schedule:
    """The schedule, built once per arguments (schedules are immutable data)."""
    return schedule_info(name).build(stages, microbatches, **dict(options))


@lru_cache(maxsize=512)
def held(name: str, stages: int, microbatches: int, options: Options) -> tuple[float, ...]:
    """Per stage, the most micro-batches the schedule holds at once (its registry formula)."""
    return tuple(schedule_info(name).memory(stages, microbatches, **dict(options)))


class CostTable:
    """Per-layer costs by micro-batch rows, asked for once per size (a profile can be slow)."""

    def __init__(self, costs: CostSource) -> None:
        if not isinstance(costs, Mapping) and not callable(costs):
            raise TypeError(f"costs: expected a mapping rows -> list of LayerCost, or a callable "
                            f"rows -> list of LayerCost; got {type(costs).__name__}")
        self._source = costs
        self._found: dict[int, Sequence[LayerCost]] = {}

    def at(self, rows: int) -> Sequence[LayerCost]:
        """The costs of a micro-batch of ``rows`` rows.

        Raises:
            ValueError: no layers, a mix of layer counts between sizes, or an
                entry that is not a LayerCost.
        """
        if rows not in self._found:
            source = self._source
            found = source[rows] if isinstance(source, Mapping) else source(rows)
            if not found or not all(isinstance(cost, LayerCost) for cost in found):
                raise ValueError(f"costs at {rows} rows: expected a non-empty list of LayerCost, "
                                 f"got {found!r:.80}")
            counts = {len(costs) for costs in self._found.values()} | {len(found)}
            if len(counts) > 1:
                raise ValueError(f"costs at {rows} rows have {len(found)} layers; other sizes "
                                 f"have {sorted(counts - {len(found)})}: expected one model")
            self._found[rows] = found
        return self._found[rows]
