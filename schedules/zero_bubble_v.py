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

from collections import deque

from schedules._checks import check_counts
from schedules.action import Action, Op, Schedule
from schedules.dependencies import ActionKey, dependency_keys


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
    order = _add_weight_gradients(critical, limit=2 * stages)
    return Schedule(stages, microbatches, order, placement, name="zb-v")


def _forward_input_order(stage: int, stages: int, microbatches: int) -> tuple[Action, ...]:
    """The forwards and input gradients of one stage, in the paper's phases."""
    down, up = stage, 2 * stages - 1 - stage
    drawn = max(microbatches, 2 * stages - 1)
    counts = {(Op.F, down): 0, (Op.F, up): 0, (Op.I, down): 0, (Op.I, up): 0}
    order: list[Action] = []

    def run(*steps: tuple[Op, int]) -> None:
        for op, chunk in steps:
            order.append(Action(op, counts[(op, chunk)], chunk))
            counts[(op, chunk)] += 1

    for _ in range(2 * (stages - stage) - 1):
        run((Op.F, down))
    for _ in range(stage):
        run((Op.F, up), (Op.F, down))
    for _ in range(stages - stage):
        run((Op.F, up), (Op.I, up))
    while counts[(Op.F, up)] < drawn:
        if counts[(Op.F, down)] < drawn:
            run((Op.F, down))
        run((Op.I, down), (Op.F, up), (Op.I, up))
    for _ in range(stage):
        run((Op.I, down), (Op.I, up))
    while counts[(Op.I, down)] < drawn:
        run((Op.I, down))
    return tuple(action for action in order if action.microbatch < microbatches)


def _add_weight_gradients(critical: Schedule, limit: int) -> tuple[tuple[Action, ...], ...]:
    """Insert each W into ``critical`` (F and I only) by replaying it with unit costs.

    At every time step each stage runs its next F or I if its inputs are there and,
    for an F, it holds fewer than ``limit`` chunk activations (or has no W to run
    instead); otherwise its oldest pending W, if any. Deterministic: each stage
    decides alone, on what finished before the step.
    """
    replay = _UnitReplay(critical, limit)
    remaining = 3 * sum(len(actions) for actions in critical.order) // 2
    step = 0
    while remaining:
        ran = [replay.next_action(stage, step) for stage in range(critical.stages)]
        if not any(ran):
            raise RuntimeError(f"{critical.name}: the replay stalled at step {step}")
        for stage, action in enumerate(ran):
            if action is not None:
                replay.record(stage, action, step)
                remaining -= 1
        step += 1
    return tuple(tuple(actions) for actions in replay.orders)


class _UnitReplay:
    """The state of the unit-cost replay: where each stage is, what it holds and owes."""

    def __init__(self, critical: Schedule, limit: int) -> None:
        self.critical = critical
        self.limit = limit
        self.orders: list[list[Action]] = [[] for _ in range(critical.stages)]
        self.position = [0] * critical.stages
        self.held = [0] * critical.stages
        self.pending: list[deque[Action]] = [deque() for _ in range(critical.stages)]
        self.finished: dict[ActionKey, int] = {}

    def next_action(self, stage: int, step: int) -> Action | None:
        """What ``stage`` runs at ``step``: its next F or I if it may, else its oldest W."""
        actions = self.critical.order[stage]
        pending = self.pending[stage]
        if self.position[stage] < len(actions):
            action = actions[self.position[stage]]
            needed = dependency_keys(self.critical, action.op, action.microbatch, action.chunk)
            ready = all(self.finished.get(key, step + 1) <= step for key in needed)
            room = action.op is not Op.F or self.held[stage] < self.limit or not pending
            if ready and room:
                self.position[stage] += 1
                return action
        return pending.popleft() if pending else None

    def record(self, stage: int, action: Action, step: int) -> None:
        """``stage`` ran ``action`` during ``step``; its result is there from ``step + 1``."""
        self.orders[stage].append(action)
        self.finished[(action.op, action.microbatch, action.chunk)] = step + 1
        self.held[stage] += {Op.F: 1, Op.I: 0, Op.W: -1}[action.op]
        if action.op is Op.I:
            self.pending[stage].append(Action(Op.W, action.microbatch, action.chunk))
