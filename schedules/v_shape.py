"""V-Half and V-Min: V-placed zero-bubble schedules with activations bounded by design.

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
stage's critical list; the weight gradients are then placed by the unit-cost replay
ZB-V uses (a stage runs its next F or I when ready, its oldest W when it would
otherwise wait or a forward would pass the memory cap), with the cap at the bound
below, so that the warm-up and cool-down are squeezed without exceeding it.

Memory (checked for P <= 16, M <= 4P): V-Min holds at most ceil((P+4)/3) full-stage
micro-batches per stage, V-Half at most ceil((P+2)/2); 1F1B holds P. With
F = I = W their bubbles are about 0.7x (V-Min) and 0.55x (V-Half) of 1F1B's at
M = 4P, a little more at M = 2P: the ramps are not filled as a greedy reordering
of the warm-up (the paper's) could fill them.
"""

from __future__ import annotations

import math
from typing import Literal

from schedules._checks import check_counts
from schedules.action import Action, Op, Schedule
from schedules.zero_bubble_v import _add_weight_gradients

Variant = Literal["v-half", "v-min"]
PERIOD = 6  # chunk actions per micro-batch per stage: F, I and W on two chunks


def v_half(stages: int, microbatches: int) -> Schedule:
    """V-Half: two chunks per stage in a V, about half of 1F1B's activations.

    Each stage holds at most ``ceil((P+2)/2)`` full-stage micro-batches (two
    half-size chunk activations counting one).

    >>> print(v_half(stages=2, microbatches=2))  # doctest: +NORMALIZE_WHITESPACE
    stage 0: F0 F0@c3 F1 I0@c3 W0@c3 F1@c3 I0 I1@c3 W0 W1@c3 I1 W1
    stage 1: F0@c1 F0@c2 F1@c1 F1@c2 I0@c2 I0@c1 W0@c2 W0@c1 I1@c2 I1@c1 W1@c2 W1@c1

    Args:
        stages: number of pipeline stages P, >= 1.
        microbatches: number of micro-batches M, >= 1 (any M).

    Returns:
        The schedule, with ``placement[c] == min(c, 2P-1-c)``, named ``"v-half"``.

    Raises:
        ValueError: a count below one.
    """
    return _v_schedule("v-half", stages, microbatches)


def v_min(stages: int, microbatches: int) -> Schedule:
    """V-Min: two chunks per stage in a V, about a third of 1F1B's activations.

    Each stage holds at most ``ceil((P+4)/3)`` full-stage micro-batches.

    >>> print(v_min(stages=2, microbatches=2))  # doctest: +NORMALIZE_WHITESPACE
    stage 0: F0 F0@c3 I0@c3 F1 W0@c3 I0 W0 F1@c3 I1@c3 W1@c3 I1 W1
    stage 1: F0@c1 F0@c2 I0@c2 I0@c1 F1@c1 F1@c2 W0@c2 W0@c1 I1@c2 I1@c1 W1@c2 W1@c1

    Args:
        stages: number of pipeline stages P, >= 1.
        microbatches: number of micro-batches M, >= 1 (any M).

    Returns:
        The schedule, with ``placement[c] == min(c, 2P-1-c)``, named ``"v-min"``.

    Raises:
        ValueError: a count below one.
    """
    return _v_schedule("v-min", stages, microbatches)


def v_memory_cap(variant: Variant, stages: int) -> int:
    """The most full-stage micro-batches a stage of ``variant`` holds: its design bound."""
    if variant == "v-half":
        return math.ceil((stages + 2) / 2)
    return math.ceil((stages + 4) / 3)


def block_times(variant: Variant, stages: int, stage: int) -> tuple[int, int, int, int]:
    """When ``stage`` starts micro-batch 0's F down, F up, I up and I down (chunk units)."""
    p, s = stages, stage
    if variant == "v-min":
        g = 2 if p % 3 == 0 else 0
        return (s, 2 * p - 1 - s, 2 * p + g + s, 4 * p - 1 + g - s)
    g = 1 if p % 2 else 4
    return (2 * s, 3 * p - 2 - s, 3 * p - 1 + g + 2 * s, 6 * p - 3 + g - s)


def _v_schedule(variant: Variant, stages: int, microbatches: int) -> Schedule:
    check_counts(stages, microbatches)
    placement = tuple(min(chunk, 2 * stages - 1 - chunk) for chunk in range(2 * stages))
    critical = Schedule(
        stages,
        microbatches,
        tuple(_critical_order(variant, stages, s, microbatches) for s in range(stages)),
        placement,
        name=variant,
    )
    limit = 2 * v_memory_cap(variant, stages)  # in half-size chunk activations
    order = _add_weight_gradients(critical, limit=limit)
    return Schedule(stages, microbatches, order, placement, name=variant)


def _critical_order(
    variant: Variant, stages: int, stage: int, microbatches: int
) -> tuple[Action, ...]:
    """The stage's Fs and Is of every micro-batch's block, in time order."""
    down, up = stage, 2 * stages - 1 - stage
    ops = ((Op.F, down), (Op.F, up), (Op.I, up), (Op.I, down))
    timed = [
        (start + PERIOD * m, Action(op, m, chunk))
        for m in range(microbatches)
        for start, (op, chunk) in zip(block_times(variant, stages, stage), ops)
    ]
    return tuple(action for _, action in sorted(timed, key=lambda item: item[0]))
