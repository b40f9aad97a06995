"""V-Half and V-Min: V-placed zero-bubble schedules with activations bounded by construction.

Qi et al. ("Pipeline Parallelism with Controllable Memory", 2024) observe that a
pipeline schedule repeated every T time units holds, on each stage, the sum of its
micro-batches' lifespans (first forward to last weight gradient) divided by T. So
they build a schedule from one micro-batch's *building block*, shifted by T per
micro-batch, and choose the block's lifespans for the memory they want.

Here the model is cut into 2P chunks placed in a V as in ZB-V (stage s holds chunk
s and chunk 2P-1-s), every backward is split into I and W, and time is counted in
chunk actions (one unit each, half a full stage's F, I or W). A stage does six
units per micro-batch (F, I, W on two chunks), so the block repeats every T = 6
units. In micro-batch 0's block, stage s starts, at:

- V-Min: F down at s, F up at 2P-1-s, I up at 2P+g+s, I down at 4P-1+g-s: each
  chain runs without a gap, the shortest lifespans there are (about 4P units in all
  per stage, so P/3 full-stage micro-batches held). The four times must differ
  modulo 6, or two micro-batches' blocks would collide: that fails only when P is a
  multiple of 3, where a gap g = 2 before the input gradients fixes it (else g = 0).
- V-Half: the forward and the input gradient on the way down move one stage every
  two units: F down at 2s, F up at 3P-2-s, I up at 3P-1+g+2s, I down at 6P-3+g-s
  (about 6P units per stage, P/2 held); distinct modulo 6 needs g = 1 for odd P and
  g = 4 for even P.

The Fs and Is of every micro-batch, in the order of their block times, make each
stage's *critical list*. The list is then replayed with unit costs under a hard
memory cap, the variant's bound below, which squeezes the warm-up and cool-down:

- a stage runs the first of the next few actions of its list that is ready (a
  later one may overtake a waiting one, so the ramps fill up), its oldest pending
  W when the head of its list is a forward that the cap refuses, and else, rather
  than wait, any ready action of its list;
- a forward never takes a stage past the cap, and a forward on the way down may be
  asked to leave room for the one on the way back up, which makes the replay
  deadlock-free (the oldest micro-batch in flight can always move on).

A few such replays (both blocks as the critical list, each also with a longer
gap, with and without overtaking, with and without the room; ``SPINES``) are tried
and the shortest kept, the search stopping at the first that meets the lower bound
below (none can be shorter); the result depends on the counts only. Stages hold at
most the cap by construction (checked by the tests for P <= 16, M <= 4P): V-Min
``ceil((P+4)/3)`` full-stage micro-batches per stage, V-Half ``ceil((P+2)/2)``;
1F1B holds P.

With F = I = W (one unit per chunk action) no schedule with the V placement and a cap
of c chunk activations per stage can idle less than max(0, 3P-1-c) + max(0, 3P-2c)
units per stage for M >= P (``v_idle_bound``). Every stage does 6M units, so each
idles the makespan E less 6M, and the last stage, which holds chunks P-1 and P,
shows it:

- warm-up: its first input gradient starts at 3P-1 at the earliest (micro-batch 0's
  forwards to chunk 2P-1 and input gradients back to chunk P). No W can come before an
  I, so until then it runs forwards only, at most c of them: it idles 3P-1-c there.
- drain: a forward of chunk P that starts at t is followed by a chain of 3P actions
  (the forwards up, the input gradients back to chunk 0, its W), so every one starts
  before E-3P (and chunk P-1's before it). The last 3P units run only I and W of
  activations held at E-3P, at most c of them, two actions each: it idles 3P-2c there.

With V-Half's cap (c = P+2 for even P, P+3 for odd) that is 3P-7 or 3P-10 units (6 at
P = 5); the replays reach it at every P in 4..16 and every M >= 2P tried: optimal.
V-Min's cap gives 5 to 53 units for P in 4..16, also reached everywhere. Against
1F1B's 6(P-1): 0.28-0.46x (V-Half) and 0.28-0.60x (V-Min) of its bubble time. As a
fraction of the step, which also counts 1F1B's longer step, the same bound
puts V-Half above 0.5x 1F1B's at M = 2P for even P >= 10 and P = 15, and at M = 4P for
P = 14 and 16 (0.50-0.55x): there no schedule within V-Half's memory bar does better.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import lru_cache
from typing import Literal

from schedules._checks import check_counts
from schedules.action import Action, Op, Schedule
from schedules.v_replay import CappedReplay, ReplayPlan, Stalled

Variant = Literal["v-half", "v-min"]
PERIOD = 6  # chunk actions per micro-batch per stage: F, I and W on two chunks


def v_half(stages: int, microbatches: int) -> Schedule:
    """V-Half: two chunks per stage in a V, about half of 1F1B's activations.

    The V: stage 0 runs chunks 0 and 3, stage 1 chunks 1 and 2, every backward split
    into I and W (from M = 3 on, in another order than ZB-V's):

    >>> print(v_half(stages=2, microbatches=3))  # doctest: +NORMALIZE_WHITESPACE
    stage 0: F0 F1 F2 F0@c3 I0@c3 W0@c3 F1@c3 I0 I1@c3 W0 W1@c3 F2@c3 I2@c3 I1 W2@c3 I2
             W1 W2
    stage 1: F0@c1 F0@c2 F1@c1 F1@c2 I0@c2 I0@c1 W0@c2 F2@c1 W0@c1 F2@c2 I1@c2 I1@c1
             I2@c2 I2@c1 W1@c2 W1@c1 W2@c2 W2@c1

    At P = 8 (F = I = W) it holds 5 micro-batches on every stage where 1F1B's stage 0
    and every stage of ZB-V (the same V at 1F1B's memory) hold 8; its step lies between:

    >>> from schedules import one_f_one_b, simulate, zero_bubble_v
    >>> for schedule in (one_f_one_b(8, 16), zero_bubble_v(8, 16), v_half(8, 16)):
    ...     timeline = simulate(schedule, forward=1, backward=1, weight=1)
    ...     print(schedule.name, max(timeline.peak_activations), timeline.makespan)
    1f1b 8.0 69.0
    zb-v 8.0 51.5
    v-half 5.0 56.5

    Args:
        stages: number of pipeline stages P, >= 1.
        microbatches: number of micro-batches M, >= 1 (any M).

    Returns:
        The schedule, with ``placement[c] == min(c, 2P-1-c)``, named ``"v-half"``; each
        stage holds at most ``ceil((P+2)/2)`` full-stage micro-batches (two half-size
        chunk activations counting one).

    Raises:
        ValueError: a count below one.
    """
    return _v_schedule("v-half", stages, microbatches)


def v_min(stages: int, microbatches: int) -> Schedule:
    """V-Min: two chunks per stage in a V, about a third of 1F1B's activations.

    Where its cap equals V-Half's (P <= 4 and P = 6) it is V-Half's schedule. From P = 5
    on it holds a micro-batch or more less on every stage and pays with a longer step
    (F = I = W):

    >>> from schedules import simulate
    >>> half, least = (simulate(generator(5, 10), forward=1, backward=1, weight=1)
    ...                for generator in (v_half, v_min))
    >>> half.peak_activations, least.peak_activations
    ((4.0, 4.0, 4.0, 4.0, 4.0), (3.0, 3.0, 3.0, 3.0, 3.0))
    >>> half.makespan, least.makespan
    (33.0, 35.5)

    Args:
        stages: number of pipeline stages P, >= 1.
        microbatches: number of micro-batches M, >= 1 (any M).

    Returns:
        The schedule, with ``placement[c] == min(c, 2P-1-c)``, named ``"v-min"``; each
        stage holds at most ``ceil((P+4)/3)`` full-stage micro-batches.

    Raises:
        ValueError: a count below one.
    """
    return _v_schedule("v-min", stages, microbatches)


def v_memory_cap(variant: Variant, stages: int) -> int:
    """The most full-stage micro-batches a stage of ``variant`` holds: its design bound."""
    if variant == "v-half":
        return math.ceil((stages + 2) / 2)
    return math.ceil((stages + 4) / 3)


def block_times(variant: Variant, stages: int, stage: int,
                gap: int | None = None) -> tuple[int, int, int, int]:
    """When ``stage`` starts micro-batch 0's F down, F up, I up and I down (chunk units).

    ``gap`` replaces the gap g before the input gradients (None: the one that keeps the
    four times distinct modulo 6)."""
    p, s = stages, stage
    if variant == "v-min":
        g = (2 if p % 3 == 0 else 0) if gap is None else gap
        return (s, 2 * p - 1 - s, 2 * p + g + s, 4 * p - 1 + g - s)
    g = (1 if p % 2 else 4) if gap is None else gap
    return (2 * s, 3 * p - 2 - s, 3 * p - 1 + g + 2 * s, 6 * p - 3 + g - s)


def v_idle_bound(variant: Variant, stages: int) -> int:
    """The fewest chunk-action units any schedule with ``variant``'s cap idles per stage.

    For unit chunk costs (F = I = W), M >= P and the V placement; the proof is in the
    module's docstring (the last stage's warm-up and drain).
    """
    p, cap = stages, 2 * v_memory_cap(variant, stages)
    return max(0, 3 * p - 1 - cap) + max(0, 3 * p - 2 * cap)


def _v_schedule(variant: Variant, stages: int, microbatches: int) -> Schedule:
    # Checked before the cache, which would take 2.0 or True for the 2 or 1 it holds.
    check_counts(stages, microbatches)
    return _searched(variant, stages, microbatches)


@lru_cache(maxsize=256)
def _searched(variant: Variant, stages: int, microbatches: int) -> Schedule:
    placement = tuple(min(chunk, 2 * stages - 1 - chunk) for chunk in range(2 * stages))
    # Where the bound holds (M >= P), a replay that meets it ends the search: none is shorter.
    shortest = 6 * microbatches + v_idle_bound(variant, stages) if microbatches >= stages else 0
    best: tuple[int, tuple[tuple[Action, ...], ...]] | None = None
    for steps, order in _replays(variant, stages, microbatches, placement):
        if best is None or steps < best[0]:
            best = (steps, order)
        if best[0] <= shortest:
            break
    assert best is not None  # the replays with room never stall
    return Schedule(stages, microbatches, best[1], placement, name=variant)


def _replays(variant: Variant, stages: int, microbatches: int, placement: tuple[int, ...]
             ) -> Iterator[tuple[int, tuple[tuple[Action, ...], ...]]]:
    """Each replay of ``SPINES`` that does not stall: its unit steps and stage orders."""
    cap = 2 * v_memory_cap(variant, stages)  # in half-size chunk activations
    for spine, gap, replays in SPINES:
        critical = Schedule(
            stages,
            microbatches,
            tuple(_critical_order(spine, stages, s, microbatches, gap) for s in range(stages)),
            placement,
            name=variant,
        )
        plan = ReplayPlan(critical)
        for window, room in replays:
            try:
                yield CappedReplay(plan, cap, window, room).run()
            except Stalled:
                continue  # only the replays without room can stall


# (window, room): how many list actions a stage looks at, and whether a forward on
# the way down leaves a slot free for the micro-batch's way back up.
REPLAYS = ((4, False), (1, False), (4, True), (1, True))
# (block, gap, replays): the critical lists tried. Beside both blocks with their
# collision-free gaps, three with a longer gap before the input gradients: their blocks
# of consecutive micro-batches collide, and the replay resolves that, with fewer idle
# units at larger P (V-Half at odd P, V-Min at P >= 8; found by trying gaps 0-8 and
# windows 1-6 at P in 4..16, M in {2P, 4P}). With them every P in 4..16 reaches
# ``v_idle_bound``.
SPINES: tuple[tuple[Variant, int | None, tuple[tuple[int, bool], ...]], ...] = (
    ("v-half", None, REPLAYS),
    ("v-min", None, REPLAYS),
    ("v-half", 5, ((2, False),)),
    ("v-min", 4, ((2, False),)),
    ("v-min", 6, ((6, False),)),
)


def _critical_order(
    variant: Variant, stages: int, stage: int, microbatches: int, gap: int | None = None
) -> tuple[Action, ...]:
    """The stage's Fs and Is of every micro-batch's block, in time order (ties, where blocks
    collide: F down, F up, I up, I down)."""
    down, up = stage, 2 * stages - 1 - stage
    ops = ((Op.F, down), (Op.F, up), (Op.I, up), (Op.I, down))
    timed = [
        (start + PERIOD * m, position, Action(op, m, chunk))
        for m in range(microbatches)
        for position, (start, (op, chunk)) in enumerate(
            zip(block_times(variant, stages, stage, gap), ops))
    ]
    return tuple(action for _, _, action in sorted(timed, key=lambda item: item[:2]))
