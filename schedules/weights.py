"""Where the weight gradients go: the W placement shared by the zero-bubble generators.

A split backward leaves each ``W`` free to run any time after its ``I``; nobody
waits for it. Two placements are shared here:

- ``lagged_stage_order``: one chunk per stage, 1F1B with ``I`` for ``B`` and each
  ``W(m)`` right after ``I(m + lag)``; ``capped_orders`` picks each stage's warm-up and
  lag for a memory cap, the one rule behind ZB-H1 (cap P), ZB-H2 (cap 2P-1) and ``zb``;
- ``add_weight_gradients``: any order of Fs and Is (ZB-V), replayed with unit
  costs, a W going wherever the stage would otherwise wait or a forward would
  pass a memory limit.
"""

from __future__ import annotations

from collections import deque

from schedules._speed import OP_F, OP_I, OP_W
from schedules.action import Action, Op, Schedule
from schedules.dependencies import ActionKey, dependency_keys


def lagged_stage_order(stage: int, microbatches: int, warmup: int, lag: int) -> tuple[Action, ...]:
    """``warmup`` forwards, then F and I in turn with W(m) right after I(m + lag), then the Ws.

    >>> print(*lagged_stage_order(stage=0, microbatches=3, warmup=1, lag=1))
    F0 F1 I0 F2 I1 W0 I2 W1 W2

    Args:
        stage: the stage (its one chunk has the same index).
        microbatches: number of micro-batches M.
        warmup: forwards before the first input gradient (at most M are run).
        lag: how many input gradients later each weight gradient runs.

    Returns:
        The stage's actions in order.
    """
    warmup = min(warmup, microbatches)
    order = [Action(Op.F, m, stage) for m in range(warmup)]
    forwards, weights = warmup, 0
    for m in range(microbatches):
        if forwards < microbatches:
            order.append(Action(Op.F, forwards, stage))
            forwards += 1
        order.append(Action(Op.I, m, stage))
        if m - lag >= 0:
            order.append(Action(Op.W, m - lag, stage))
            weights = m - lag + 1
    order.extend(Action(Op.W, m, stage) for m in range(weights, microbatches))
    return tuple(order)


def capped_orders(stages: int, microbatches: int, cap: int) -> tuple[tuple[Action, ...], ...]:
    """Every stage's ``lagged_stage_order`` when a stage may hold ``cap`` micro-batches (>= P).

    With ``e = min(cap - P, P - 1, M - P)`` extra micro-batches (at least 0), stage s runs
    ``a = min(P-1-s, e)`` more warm-up forwards than ZB-H1 and lags its Ws ``e - a`` more,
    or ``min(s, e)`` more from ``cap = 2P-1`` on (ZB-H2); it holds ``min(P + e, M)``.

    >>> for actions in capped_orders(stages=2, microbatches=3, cap=3): print(*actions)
    F0 F1 F2 I0 W0 I1 W1 I2 W2
    F0@c1 I0@c1 F1@c1 I1@c1 F2@c1 I2@c1 W0@c1 W1@c1 W2@c1
    """
    extra = max(0, min(cap - stages, stages - 1, microbatches - stages))
    orders = []
    for stage in range(stages):
        # Stage s holds about warm-up + lag + 1 micro-batches: of its e extra, it spends
        # what it can on warm-up forwards (more on early stages) and the rest on lag.
        early = min(stages - 1 - stage, extra)
        late = min(stage, extra) if cap >= 2 * stages - 1 else extra - early
        orders.append(lagged_stage_order(stage, microbatches, warmup=stages - 1 - stage + early,
                                         lag=stage + late))
    return tuple(orders)


def add_weight_gradients(critical: Schedule, limit: int) -> tuple[tuple[Action, ...], ...]:
    """Insert each W into ``critical`` (F and I only) by replaying it with unit costs.

    At every time step each stage runs its next F or I if its inputs are there and,
    for an F, it holds fewer than ``limit`` chunk activations (or has no W to run
    instead); otherwise its oldest pending W, if any. Deterministic: each stage
    decides alone, on what finished before the step.

    Args:
        critical: the schedule's Fs and Is, every stage in its order.
        limit: chunk activations a stage may hold before a pending W goes first.

    Returns:
        Every stage's order with its Ws inserted.

    Raises:
        RuntimeError: the replay stalled (``critical`` cannot run).
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


_HELD_CHANGE = {OP_F: 1, OP_I: 0, OP_W: -1}  # activations a stage holds after each op


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
            room = action.op is not OP_F or self.held[stage] < self.limit or not pending
            if ready and room:
                self.position[stage] += 1
                return action
        return pending.popleft() if pending else None

    def record(self, stage: int, action: Action, step: int) -> None:
        """``stage`` ran ``action`` during ``step``; its result is there from ``step + 1``."""
        self.orders[stage].append(action)
        self.finished[(action.op, action.microbatch, action.chunk)] = step + 1
        op = action.op
        self.held[stage] += _HELD_CHANGE[op]
        if op is OP_I:
            self.pending[stage].append(Action(OP_W, action.microbatch, action.chunk))
