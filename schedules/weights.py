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

import sys
from array import array
from collections import deque

from schedules.action import CODE_F, CODE_I, CODE_W, Action, Op, Schedule, StageOrder
from schedules.flat import flatten


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


def add_weight_gradients(critical: Schedule, limit: int) -> tuple[StageOrder, ...]:
    """Insert each W into ``critical`` (F and I only) by replaying it with unit costs.

    At every time step each stage runs its next F or I if its inputs are there and,
    for an F, it holds fewer than ``limit`` chunk activations (or has no W to run
    instead); otherwise its oldest pending W, if any. Deterministic: each stage
    decides alone, on what finished before the step. Works on the schedule's keys
    (``schedules.flat``): no object per action.

    Args:
        critical: the schedule's Fs and Is, every stage in its order.
        limit: chunk activations a stage may hold before a pending W goes first.

    Returns:
        Every stage's order with its Ws inserted.

    Raises:
        RuntimeError: the replay stalled (``critical`` cannot run).
    """
    flat = flatten(critical)
    # Per key, the step from which its result is there; one more entry, read as
    # ``finished[-1]``, makes "no dependency" (-1) one that is always there: no test for it.
    finished = array("q", [1 << 62]) * flat.size + array("q", [0])
    ran: list[list[int]] = [[] for _ in range(critical.stages)]
    positions = [0] * critical.stages
    held = [0] * critical.stages
    pending: list[deque[int]] = [deque() for _ in range(critical.stages)]
    columns = list(zip(flat.keys, flat.first, flat.second, pending, ran, map(len, flat.keys)))
    remaining = 3 * sum(len(keys) for keys in flat.keys) // 2
    step = 0
    while remaining:
        before = remaining
        # A result is there from the step after it ran, so a stage's choice at this step
        # depends only on earlier steps: each stage decides and records in turn.
        for stage, (keys, first, second, waiting, done, length) in enumerate(columns):
            position, key = positions[stage], -1
            if position < length:
                if (finished[first[position]] <= step and finished[second[position]] <= step
                        and (held[stage] < limit or keys[position] & 3 != CODE_F
                             or not waiting)):
                    positions[stage] = position + 1
                    key = keys[position]
            if key < 0:
                if not waiting:
                    continue
                key = waiting.popleft()
            done.append(key)
            finished[key] = step + 1
            code = key & 3
            if code == CODE_F:
                held[stage] += 1
            elif code == CODE_W:
                held[stage] -= 1
            else:
                waiting.append(key + 1)  # an I: its W
            remaining -= 1
        if remaining == before:
            raise RuntimeError(f"{critical.name}: the replay stalled at step {step}")
        step += 1
    return tuple(_stage_order(keys, critical.chunks) for keys in ran)


def _stage_order(keys: list[int], chunks: int) -> StageOrder:
    """The StageOrder of a stage's ``keys`` (``schedules.flat``); the codes, the keys' low two
    bits, are read off their low bytes at C speed."""
    span = 4 * chunks
    data = array("q", keys).tobytes()
    low = data[:: 8] if sys.byteorder == "little" else data[7:: 8]
    return StageOrder(low.translate(_LOW_TWO_BITS),
                      array("q", [key // span for key in keys]),
                      array("q", [(key >> 2) % chunks for key in keys]))


_LOW_TWO_BITS = bytes(byte & 3 for byte in range(256))
