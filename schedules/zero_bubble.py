"""Zero-bubble schedules ZB-H1 and ZB-H2: 1F1B with the backward split into I and W.

Qi et al. ("Zero Bubble Pipeline Parallelism", ICLR 2024) split a backward into
``I``, the gradient with respect to the stage input, which the stage before waits
for, and ``W``, the gradient with respect to the weights, which nobody waits for.
Running I as soon as possible shortens the critical path; W then fills the gaps.

Both schedules here are 1F1B with ``I`` in place of ``B`` and with stage s running
each ``W`` a fixed number of micro-batches after its ``I``. The lag grows with s
because the gaps are at the end: once the last forward is done, the input
gradients race back through the stages one ``I`` at a time, and stage s fills
the wait with the weight gradients it held back. With F = I = W that gives a
bubble of (P-1) F per stage, the ramp-up no schedule avoids.

Memory is counted as ``Timeline.peak_activations`` does: a micro-batch's
activations stay until its ``W`` ends. Reaching the bound then needs every stage
to hold P micro-batches, the most 1F1B holds (on its stage 0), not 1F1B's
``P - s`` on stage s. To finish at the bound, the last stage works without a
break from time P-1 to the end, and each I it runs must still cross P-1 stages
and be followed by a W on stage 0: so its last P time units hold only Ws, and P
of its micro-batches are still held when its last I ends.
"""

from __future__ import annotations

from schedules._checks import check_counts
from schedules.action import Schedule
from schedules.weights import capped_orders


def zero_bubble_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with I for B, stage s running W(m) after I(m + s).

    Every stage holds at most ``min(P, M)`` micro-batches, the peak of 1F1B
    (reached there on stage 0 only). With F = I = W the bubble is (P-1) F per
    stage, a third of 1F1B's, and the ramp-up bound: a fraction
    (P-1)/(3M+P-1) when M >= P.

    >>> print(zero_bubble_h1(stages=3, microbatches=4))
    stage 0: F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3
    stage 1: F0@c1 F1@c1 I0@c1 F2@c1 I1@c1 W0@c1 F3@c1 I2@c1 W1@c1 I3@c1 W2@c1 W3@c1
    stage 2: F0@c2 I0@c2 F1@c2 I1@c2 F2@c2 I2@c2 W0@c2 F3@c2 I3@c2 W1@c2 W2@c2 W3@c2

    Args:
        stages: number of pipeline stages P, >= 1.
        microbatches: number of micro-batches M, >= 1 (any M).

    Returns:
        The schedule, one chunk per stage, named ``"zb-h1"``: the stage orders of
        ``zero_bubble_capped`` at its least memory, ``max_inflight=P``.

    Raises:
        ValueError: a count below one.
    """
    check_counts(stages, microbatches)
    return Schedule(stages, microbatches, capped_orders(stages, microbatches, cap=stages),
                    name="zb-h1")


def zero_bubble_h2(stages: int, microbatches: int) -> Schedule:
    """ZB-H2: ZB-H1 with up to P-1 more micro-batches in flight, to fill the cool-down.

    With ``e = min(P-1, M-P)`` extra micro-batches (none when M <= P, where this is
    ZB-H1), stage s runs ``min(P-1-s, e)`` more warm-up forwards than ZB-H1 and
    lags its W by ``s + min(s, e)`` instead of s; each stage holds at most
    ``min(P + e, M)`` micro-batches, under twice 1F1B's peak. With F = I it is
    never slower than ZB-H1 for W <= F, and faster when 0 < W < F and M > P; with
    F = I = W it reaches the ramp-up bound, (P-1) F per stage, like ZB-H1, and with
    M >= 2P-1 it does so for any F/2 <= W <= F too (below F/2 the last stage would
    have to hold back more than 2P-1 weight gradients to fill the cool-down).

    >>> print(zero_bubble_h2(stages=3, microbatches=5))  # doctest: +NORMALIZE_WHITESPACE
    stage 0: F0 F1 F2 F3 F4 I0 W0 I1 W1 I2 W2 I3 W3 I4 W4
    stage 1: F0@c1 F1@c1 F2@c1 I0@c1 F3@c1 I1@c1 F4@c1 I2@c1 W0@c1 I3@c1 W1@c1
             I4@c1 W2@c1 W3@c1 W4@c1
    stage 2: F0@c2 I0@c2 F1@c2 I1@c2 F2@c2 I2@c2 F3@c2 I3@c2 F4@c2 I4@c2 W0@c2
             W1@c2 W2@c2 W3@c2 W4@c2

    Args:
        stages: number of pipeline stages P, >= 1.
        microbatches: number of micro-batches M, >= 1 (any M).

    Returns:
        The schedule, one chunk per stage, named ``"zb-h2"``: the stage orders of
        ``zero_bubble_capped`` from ``max_inflight=2P-1`` on.

    Raises:
        ValueError: a count below one.
    """
    check_counts(stages, microbatches)
    return Schedule(stages, microbatches, capped_orders(stages, microbatches, cap=2 * stages - 1),
                    name="zb-h2")
