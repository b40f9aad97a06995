"""ZB with a memory cap: zero-bubble schedules between ZB-H1 and ZB-H2, by micro-batches in flight.

ZB-H1 holds P micro-batches per stage and ZB-H2 up to 2P-1; both are 1F1B with
I for B, stage s running W(m) a fixed lag after I(m), and ZB-H2 adds warm-up
forwards (see ``schedules.zero_bubble``). Between them lies a frontier: with
``k = max_inflight`` and ``e = min(k - P, P - 1, M - P)`` extra micro-batches,
stage s runs ``a = min(P-1-s, e)`` more warm-up forwards than ZB-H1 and lags its
Ws ``e - a`` more, so it holds at most ``min(P + e, M)``: the early stages fill
the cool-down with forwards, the late ones with held-back weight gradients.
From ``k = 2P-1`` on it is ZB-H2 exactly, whose lag is ``s + min(s, e)``. A planner walks k from P to 2P-1 and trades memory
for bubble.
"""

from __future__ import annotations

from schedules._checks import check_counts
from schedules.action import Schedule
from schedules.weights import capped_orders


def zero_bubble_capped(stages: int, microbatches: int, max_inflight: int | None = None) -> Schedule:
    """Zero-bubble 1F1B whose stages hold at most ``max_inflight`` micro-batches.

    ``max_inflight = P`` (the default) is ZB-H1 exactly, ``2P-1`` is ZB-H2 exactly,
    and larger values are ZB-H2 (it already fills the cool-down). Each stage holds
    ``min(P + e, M)`` micro-batches with ``e = min(k - P, P - 1, max(0, M - P))``.

    One micro-batch more than ZB-H1 (where stage s runs P-1-s forwards before its first I
    and W(m) after I(m + s)): stages 0 and 1 spend it on one more forward before their
    first I, stage 2 on running each W one I later:

    >>> print(zero_bubble_capped(stages=3, microbatches=4, max_inflight=4))
    stage 0: F0 F1 F2 F3 I0 W0 I1 W1 I2 W2 I3 W3
    stage 1: F0@c1 F1@c1 F2@c1 I0@c1 F3@c1 I1@c1 W0@c1 I2@c1 W1@c1 I3@c1 W2@c1 W3@c1
    stage 2: F0@c2 I0@c2 F1@c2 I1@c2 F2@c2 I2@c2 F3@c2 I3@c2 W0@c2 W1@c2 W2@c2 W3@c2

    The frontier: each micro-batch more held per stage buys a step shorter by half a W
    (W costing half an F), from ZB-H1 (k = P = 3) to ZB-H2 (k = 2P-1 = 5):

    >>> from schedules import simulate
    >>> for k in (3, 4, 5):
    ...     schedule = zero_bubble_capped(stages=3, microbatches=6, max_inflight=k)
    ...     timeline = simulate(schedule, forward=1, backward=1, weight=0.5)
    ...     print(k, max(timeline.peak_activations), timeline.makespan)
    3 3.0 18.0
    4 4.0 17.5
    5 5.0 17.0

    Args:
        stages: number of pipeline stages P, >= 1.
        microbatches: number of micro-batches M, >= 1 (any M).
        max_inflight: micro-batches a stage may hold, an int >= P; None means P.

    Returns:
        The schedule, one chunk per stage, named ``"zb"``.

    Raises:
        ValueError: a count below one, or ``max_inflight`` not an int >= P.
    """
    check_counts(stages, microbatches)
    cap = stages if max_inflight is None else max_inflight
    if isinstance(cap, bool) or not isinstance(cap, int):
        raise ValueError(f"max_inflight must be an int >= stages, got {max_inflight!r}")
    if cap < stages:
        raise ValueError(
            f"max_inflight must be >= stages: expected at least {stages} (ZB-H1's memory), "
            f"got max_inflight={cap}; for less memory use v-half or v-min"
        )
    return Schedule(stages, microbatches, capped_orders(stages, microbatches, cap), name="zb")
