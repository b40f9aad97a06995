"""Interleaved 1F1B (Megatron-LM): v model chunks per stage cut the bubble time by v.

Stage s holds chunks s, s+P, s+2P, ... of a model cut into v x P chunks, so a
micro-batch crosses every stage v times. Each stage walks one list of
(micro-batch, chunk) forwards and one of backwards, both in groups of micro-batches:
for each group, every chunk in turn runs the whole group, forwards in chunk order
and backwards in reverse. The stage runs ``(v-1) x g + 2(P-1-s)`` forwards first
(g, the size of the first group), then pairs one forward with one backward, then
drains the backwards, as in 1F1B.

A group must hold at least P micro-batches, or chunk c+1's first forward on stage
0 waits for micro-batch 0 to come round the ring. So M is cut into ``M // P``
groups as evenly as possible, larger groups first (the warm-up is sized by the
first group; a later, larger one would put a backward before its own forward): with M a
multiple of P every group holds P micro-batches, Megatron's schedule exactly, and
the bubble time is 1F1B's divided by v. Other M work too, at a little more memory
and (for M < P) a bubble from those waits. The factor 2 in the warm-up is
Megatron's: a stage keeps running forwards while its first gradient makes the
round trip, so it tolerates communication delays.
"""

from __future__ import annotations

from schedules._checks import check_counts
from schedules.action import Action, Op, Schedule
from schedules.onefoneb import one_f_one_b

# (micro-batch, local chunk): the local chunk j of stage s is model chunk j*P + s.
_Item = tuple[int, int]


def interleaved_1f1b(stages: int, microbatches: int, chunks_per_stage: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: stage s holds chunks s, s+P, ..., s+(v-1)P.

    With v = ``chunks_per_stage``, each chunk costs 1/v of a stage, so the ramp-up
    and ramp-down of the pipeline, and with them the bubble time, shrink by v; a
    micro-batch crosses stages v times as often, so point-to-point traffic grows by
    about v. With one chunk per stage this is plain 1F1B.

    >>> print(interleaved_1f1b(stages=2, microbatches=4))  # doctest: +NORMALIZE_WHITESPACE
    stage 0: F0 F1 F0@c2 F1@c2 F2 B0@c2 F3 B1@c2
             F2@c2 B0 F3@c2 B1 B2@c2 B3@c2 B2 B3
    stage 1: F0@c1 F1@c1 F0@c3 B0@c3 F1@c3 B1@c3 F2@c1 B0@c1
             F3@c1 B1@c1 F2@c3 B2@c3 F3@c3 B3@c3 B2@c1 B3@c1

    Args:
        stages: number of pipeline stages P, >= 1.
        microbatches: number of micro-batches M, >= 1. Any M works; the bubble
            time is exactly 1F1B's / v when M is a multiple of P (Megatron's
            requirement), and for M < P chunk changes leave extra gaps.
        chunks_per_stage: model chunks per stage v, >= 1.

    Returns:
        The schedule, with ``placement[c] == c % stages`` and name ``"interleaved-1f1b"``.

    Raises:
        ValueError: a count below one, or ``chunks_per_stage`` not an int >= 1.
    """
    check_counts(stages, microbatches)
    if isinstance(chunks_per_stage, bool) or not isinstance(chunks_per_stage, int):
        raise ValueError(f"chunks_per_stage must be an int >= 1, got {chunks_per_stage!r}")
    if chunks_per_stage < 1:
        raise ValueError(
            f"chunks_per_stage must be >= 1, got chunks_per_stage={chunks_per_stage}"
        )
    placement = tuple(chunk % stages for chunk in range(chunks_per_stage * stages))
    if chunks_per_stage == 1:
        order = one_f_one_b(stages, microbatches).order
        return Schedule(stages, microbatches, order, placement, name="interleaved-1f1b")

    groups = _groups(stages, microbatches)
    chunks = range(chunks_per_stage)
    forwards = [(m, j) for group in groups for j in chunks for m in group]
    backwards = [(m, j) for group in groups for j in reversed(chunks) for m in group]
    orders: list[tuple[Action, ...]] = []
    for stage in range(stages):
        warmup = (chunks_per_stage - 1) * len(groups[0]) + 2 * (stages - 1 - stage)
        orders.append(_stage_order(stage, stages, forwards, backwards, warmup))
    return Schedule(stages, microbatches, tuple(orders), placement, name="interleaved-1f1b")


def _groups(stages: int, microbatches: int) -> list[range]:
    """Cut 0..M-1 into ``max(1, M // P)`` consecutive groups, sizes even, larger first."""
    count = max(1, microbatches // stages)
    size, larger = divmod(microbatches, count)
    groups, start = [], 0
    for index in range(count):
        end = start + size + (1 if index < larger else 0)
        groups.append(range(start, end))
        start = end
    return groups


def _stage_order(
    stage: int, stages: int, forwards: list[_Item], backwards: list[_Item], warmup: int
) -> tuple[Action, ...]:
    def forward(item: _Item) -> Action:
        return Action(Op.F, item[0], item[1] * stages + stage)

    def backward(item: _Item) -> Action:
        return Action(Op.B, item[0], item[1] * stages + stage)

    warmup = min(warmup, len(forwards))
    order = [forward(item) for item in forwards[:warmup]]
    for step, item in enumerate(forwards[warmup:]):
        order.append(forward(item))
        order.append(backward(backwards[step]))
    order.extend(backward(item) for item in backwards[len(forwards) - warmup :])
    return tuple(order)
