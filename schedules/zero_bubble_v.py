"""ZB-V: the zero-bubble schedule with two chunks per stage placed in a V (Qi et al., 2024).

The model is cut into 2P chunks; stage s holds chunk s on the way down and chunk
2P-1-s on the way back up, so stage 0 holds both the first and the last chunk. A
micro-batch's forward runs down the stages and back up, its input gradients down
and back up again, and the last stage turns each of them round without a hop.
Each stage holds one chunk from each half of the model, so the activations the
stages hold are balanced, and stage 0, which ends the model, starts the first
input gradient as soon as the first forward has crossed the V.

The order is built in two steps. First the forwards and input gradients, in the
phases the paper draws (warm-up forwards of the down chunk, then of both,
forward-and-input-gradient on the up chunk, a steady state of one F and one I per
chunk, and a cool-down of input gradients); for fewer than 2P-1 micro-batches the
pattern is drawn for 2P-1 and the missing micro-batches are left out. Then the
weight gradients, placed by replaying that order with F = I = W, one time unit
each, as the paper's greedy scheduler does under a memory limit: a stage runs its
next F or I as soon as that is ready, and its oldest pending W whenever it would
otherwise wait, or when a forward would take it past 2P chunk activations, which
is P stages' worth, 1F1B's peak. With F = I = W the bubble is then the ramp-up bound,
(P-1) F / 2 per stage, for every M >= P (checked for P <= 12, M <= 6P).
"""

from __future__ import annotations

from array import array

from schedules._checks import check_counts
from schedules.action import CODE_F, CODE_I, Schedule, StageOrder
from schedules.weights import add_weight_gradients


def zero_bubble_v(stages: int, microbatches: int) -> Schedule:
    """ZB-V: two chunks per stage in a V, stage s holding chunks s and 2P-1-s.

    Each stage holds at most P micro-batches' worth of activations (2P chunk
    activations of half a stage each), 1F1B's peak. With F = I = W the bubble is
    (P-1) F / 2 per stage, the ramp-up bound for this placement, for every M >= P.

    >>> print(zero_bubble_v(stages=2, microbatches=2))  # doctest: +NORMALIZE_WHITESPACE
    stage 0: F0 F1 F0@c3 I0@c3 F1@c3 I1@c3 I0 W0@c3 I1 W1@c3 W0 W1
    stage 1: F0@c1 F0@c2 F1@c1 F1@c2 I0@c2 I0@c1 I1@c2 I1@c1
             W0@c2 W0@c1 W1@c2 W1@c1

    Args:
        stages: number of pipeline stages P, >= 1.
        microbatches: number of micro-batches M, >= 1 (any M).

    Returns:
        The schedule, with ``placement[c] == c`` for c < P and ``2P-1-c`` after,
        named ``"zb-v"``.

    Raises:
        ValueError: a count below one.
    """
    check_counts(stages, microbatches)
    placement = tuple(min(chunk, 2 * stages - 1 - chunk) for chunk in range(2 * stages))
    critical = Schedule(
        stages,
        microbatches,
        tuple(_forward_input_order(stage, stages, microbatches) for stage in range(stages)),
        placement,
        name="zb-v",
    )
    order = add_weight_gradients(critical, limit=2 * stages)
    return Schedule(stages, microbatches, order, placement, name="zb-v")


def _forward_input_order(stage: int, stages: int, microbatches: int) -> StageOrder:
    """The forwards and input gradients of one stage, in the paper's phases.

    Each phase repeats a few steps (F or I, down or up chunk); the n-th step of a kind runs
    micro-batch n. The phases are drawn for at least 2P-1 micro-batches, the missing ones
    then left out.
    """
    down, up = stage, 2 * stages - 1 - stage
    drawn = max(microbatches, 2 * stages - 1)
    steps = (
        [_F_DOWN] * (2 * (stages - stage) - 1)  # warm-up: forwards down
        + [_F_UP, _F_DOWN] * stage  # both
        + [_F_UP, _I_UP] * (stages - stage)  # forward and input gradient on the up chunk
        # steady state: one F and one I per chunk, until the forwards down run out
        + [_F_DOWN, _I_DOWN, _F_UP, _I_UP] * (drawn - 2 * stages + stage + 1)
        + [_I_DOWN, _F_UP, _I_UP] * (stages - stage - 1)
        + [_I_DOWN, _I_UP] * stage  # cool-down
        + [_I_DOWN] * (stages - stage)
    )
    codes, chunks = (CODE_F, CODE_F, CODE_I, CODE_I), (down, up, down, up)
    counts = [0, 0, 0, 0]
    ops, numbers, placed = bytearray(), array("q"), array("q")
    for step in steps:
        microbatch = counts[step]
        counts[step] = microbatch + 1
        if microbatch < microbatches:
            ops.append(codes[step])
            numbers.append(microbatch)
            placed.append(chunks[step])
    return StageOrder(bytes(ops), numbers, placed)


_F_DOWN, _F_UP, _I_DOWN, _I_UP = range(4)  # the steps of _forward_input_order
