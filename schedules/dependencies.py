"""The dependency rule between actions, written once for validator, simulator and runtime."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from schedules._speed import OP_B, OP_F, OP_I, OP_W
from schedules.action import Action, Op, Schedule

ActionKey = tuple[Op, int, int]


def dependency_keys(schedule: Schedule, op: Op, microbatch: int, chunk: int) -> tuple[ActionKey, ...]:
    """The rule itself, on ``(op, microbatch, chunk)`` keys; see ``dependencies``.

    The linear passes read the same rule on integer keys (``schedules.flat.flatten``); the
    reference table (tests/schedules/test_reference_table.py) holds the two together.
    """
    if op is OP_F:
        return ((OP_F, microbatch, chunk - 1),) if chunk > 0 else ()
    if op is OP_W:
        return ((OP_I, microbatch, chunk),)
    if chunk == schedule.chunks - 1:
        return ((OP_F, microbatch, chunk),)
    later_op = OP_I if (microbatch, chunk + 1) in schedule.split_backward else OP_B
    return ((OP_F, microbatch, chunk), (later_op, microbatch, chunk + 1))


def received(schedule: Schedule, action: Action) -> ActionKey | None:
    """The one dependency of ``action`` that another chunk produces (the result it receives
    across a chunk boundary), or None: chunk 0's forward starts from the caller's input, the
    last chunk's backward from the loss, and a W from its own chunk's I."""
    for key in dependency_keys(schedule, action.op, action.microbatch, action.chunk):
        if key[2] != action.chunk:
            return key
    return None


def crossings(placement: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """Every chunk boundary between two stages, as ``(chunk, source, destination)``: chunk
    ``chunk``'s outputs go from stage ``source`` to stage ``destination`` (chunk + 1's), and
    the gradients of those outputs come back the other way."""
    return tuple((chunk, placement[chunk], placement[chunk + 1])
                 for chunk in range(len(placement) - 1) if placement[chunk] != placement[chunk + 1])


def dependencies(schedule: Schedule, action: Action) -> tuple[Action, ...]:
    """The actions whose results ``action`` consumes, on any stage.

    - ``F(m, c)`` needs the activation from ``F(m, c-1)``;
    - ``B(m, c)`` and ``I(m, c)`` need their own ``F(m, c)`` and the input gradient
      from chunk ``c+1``'s backward (``B`` or ``I``, whichever that chunk uses);
    - ``W(m, c)`` needs ``I(m, c)``, which keeps what the weight gradient uses.
    """
    keys = dependency_keys(schedule, action.op, action.microbatch, action.chunk)
    return tuple(Action(*key) for key in keys)


def stage_of(schedule: Schedule, action: Action) -> int:
    """The stage that must run ``action``: the one holding its model chunk."""
    return schedule.placement[action.chunk]


@dataclass(frozen=True)
class Transfer:
    """A tensor crossing stages: ``producer``'s result, sent to the stage running ``consumer``.

    The payload is the chunk's output activation when the producer is a forward,
    and the gradient with respect to the chunk's input when it is a backward.
    """

    producer: Action
    consumer: Action
    source: int
    destination: int


def transfers(schedule: Schedule) -> tuple[Transfer, ...]:
    """Every cross-stage dependency of the schedule: the sends and receives it implies."""
    found = []
    for stage, actions in enumerate(schedule.order):
        for action in actions:
            for needed in dependencies(schedule, action):
                source = stage_of(schedule, needed)
                if source != stage:
                    found.append(Transfer(needed, action, source, stage))
    return tuple(found)


def replay(
    schedule: Schedule,
) -> Iterator[tuple[int, Action, tuple[ActionKey, ...]]]:
    """Yield ``(stage, action, needed)`` in an order that respects dependencies and stage order.

    ``needed`` holds the ``(op, microbatch, chunk)`` keys of the action's dependencies.
    Each stage runs its list in order and waits at an action whose inputs are not
    yet produced. The iteration stops early if every stage is waiting: a deadlock
    (or a missing producer). Linear in the number of actions.
    """
    positions = [0] * schedule.stages
    done: set[ActionKey] = set()
    waiting: dict[ActionKey, list[int]] = {}
    ready = deque(range(schedule.stages))
    while ready:
        stage = ready.popleft()
        actions = schedule.order[stage]
        position = positions[stage]
        while position < len(actions):
            action = actions[position]
            key = (action.op, action.microbatch, action.chunk)
            needed = dependency_keys(schedule, *key)
            blocker = None
            for dependency in needed:
                if dependency not in done:
                    blocker = dependency
                    break
            if blocker is not None:
                waiting.setdefault(blocker, []).append(stage)
                break
            done.add(key)
            position += 1
            positions[stage] = position
            yield stage, action, needed
            if key in waiting:
                ready.extend(waiting.pop(key))
