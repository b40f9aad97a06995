"""A timetable as integer keys: the dependency rule and the replay on arrays, for linear passes.

An action's key is ``(microbatch * chunks + chunk) * 4 + code`` (``OPS[code]`` is its op),
so the keys of a schedule number ``0 .. 4 * microbatches * chunks - 1`` and "done", "ends"
and "where" are flat arrays indexed by key. ``flatten`` computes, once per schedule, every
action's key and the keys of its dependencies, by the rule of
``schedules.dependencies.dependency_keys`` (the reference table pins the two together):

- ``F(m, c)`` needs ``F(m, c-1)``; ``W(m, c)`` needs ``I(m, c)``;
- ``B(m, c)`` and ``I(m, c)`` need ``F(m, c)`` and, below the last chunk, chunk ``c+1``'s
  backward of ``m`` (``I`` where that one is split, else ``B``).

The validator, the simulator and the comm plan read these arrays; they make no object per
action. Only a schedule whose micro-batches and chunks are in range can be flattened, so the
validator checks that first.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass

from schedules.action import CODE_F, CODE_I, CODE_W, Schedule

_FLAT = "_flat"


@dataclass(frozen=True)
class Flat:
    """Every stage's actions as keys, with the keys they need (-1: none).

    Attributes:
        keys: per stage, each action's key.
        first: per stage, each action's first dependency: ``F(m, c-1)`` for a forward,
            ``I(m, c)`` for a W, ``F(m, c)`` for a B or I.
        second: per stage, a B's or I's input gradient from chunk ``c+1``.
        size: ``4 * microbatches * chunks``, the number of keys.
    """

    keys: tuple[array[int], ...]
    first: tuple[array[int], ...]
    second: tuple[array[int], ...]
    size: int


def flatten(schedule: Schedule) -> Flat:
    """The keys of ``schedule`` (cached on it: a schedule is immutable). Indices in range."""
    cached = schedule.__dict__.get(_FLAT)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    chunks, last = schedule.chunks, schedule.chunks - 1
    # Per (micro-batch, chunk): the code of the op that gives its input gradient.
    backward = bytearray(b"\x01") * (schedule.microbatches * chunks)
    for order in schedule.orders:
        at = order.ops.find(CODE_I)
        while at >= 0:
            backward[order.microbatches[at] * chunks + order.chunks[at]] = CODE_I
            at = order.ops.find(CODE_I, at + 1)
    keys, firsts, seconds = [], [], []
    for order in schedule.orders:
        stage_keys, first, second = array("q"), array("q"), array("q")
        for code, microbatch, chunk in zip(order.ops, order.microbatches, order.chunks):
            unit = microbatch * chunks + chunk
            base = unit * 4
            stage_keys.append(base + code)
            if code == CODE_F:
                first.append(base - 4 if chunk else -1)
                second.append(-1)
            elif code == CODE_W:
                first.append(base + CODE_I)
                second.append(-1)
            else:
                first.append(base)
                second.append(base + 4 + backward[unit + 1] if chunk < last else -1)
        keys.append(stage_keys)
        firsts.append(first)
        seconds.append(second)
    flat = Flat(tuple(keys), tuple(firsts), tuple(seconds), 4 * schedule.microbatches * chunks)
    schedule.__dict__[_FLAT] = flat
    return flat


def replay_stages(schedule: Schedule, flat: Flat) -> tuple[array[int], array[int]]:
    """An order of the actions that respects dependencies and stage order, as runs.

    Each stage runs its list in order and waits at an action whose inputs are not yet
    produced: run n is ``counts[n]`` actions of stage ``stages[n]``, the next ones in its
    order. Stops early if every stage is waiting (a deadlock): then the counts sum to less
    than the schedule's actions. Linear in the actions.

    Returns:
        ``(stages, counts)``, one entry per run.
    """
    done = bytearray(flat.size)
    positions = [0] * schedule.stages
    waiting: dict[int, list[int]] = {}
    ready = deque(range(schedule.stages))
    stages, counts = array("l"), array("l")
    while ready:
        stage = ready.popleft()
        keys, first, second = flat.keys[stage], flat.first[stage], flat.second[stage]
        position = began = positions[stage]
        count = len(keys)
        while position < count:
            needed = first[position]
            if needed >= 0 and not done[needed]:
                waiting.setdefault(needed, []).append(stage)
                break
            needed = second[position]
            if needed >= 0 and not done[needed]:
                waiting.setdefault(needed, []).append(stage)
                break
            key = keys[position]
            done[key] = 1
            position += 1
            if key in waiting:
                ready.extend(waiting.pop(key))
        if position > began:
            stages.append(stage)
            counts.append(position - began)
        positions[stage] = position
    return stages, counts
