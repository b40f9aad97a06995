"""The proof of ``validate_comm`` on a plan's arrays: complete, matched, and free of stalls
under NCCL's rules, in time linear in the steps and with no object per step.

It answers yes or no; on no, ``validate_comm`` replays the plan on its objects to name the
fault (the checks and their messages live there, once).
"""

from __future__ import annotations

from array import array
from collections import deque

from schedules.comm import CommPlan
from schedules.comm_messages import find_messages
from schedules.comm_ops import MAX_CHANNELS
from schedules.flat import flatten
from schedules.plan_steps import ACTION_STEP, SEND, PlanSteps


def plan_is_sound(plan: CommPlan) -> bool:
    """Whether ``validate_comm`` passes ``plan``, whose stages are all ``PlanSteps`` and whose
    schedule is valid."""
    schedule = plan.schedule
    stages: list[PlanSteps] = [steps for steps in plan.stages if isinstance(steps, PlanSteps)]
    if len(stages) != schedule.stages:
        return False
    for stage, steps in enumerate(stages):
        ops = steps.ops
        if steps.actions != schedule.orders[stage]:
            return False
        if ops.kinds and (min(ops.peers) < 0 or max(ops.peers) >= schedule.stages
                          or stage in set(ops.peers) or min(ops.channels) < 0
                          or max(ops.channels) >= MAX_CHANNELS):
            return False
    return _messages_are_right(plan, stages) and not _stalls(stages)


def _messages_are_right(plan: CommPlan, stages: list[PlanSteps]) -> bool:
    """Each message sent once after its producer by its source, received once before its
    first use by its destination, and per channel and pair sends and receives in one order."""
    schedule = plan.schedule
    flat = flatten(schedule)
    messages = find_messages(schedule, flat)
    chunks = schedule.chunks
    # Per producer key: its message, and the step (not action) indices that matter.
    message_of = array("q", [-1]) * flat.size
    for message, key in enumerate(messages.producer):
        message_of[key] = message
    step_of = [array("q", (at for at, kind in enumerate(steps.kinds) if kind == ACTION_STEP))
               for steps in stages]
    sent, received = bytearray(len(messages.producer)), bytearray(len(messages.producer))
    queues: dict[tuple[int, int, int, int], list[int]] = {}
    for stage, steps in enumerate(stages):
        ops, group = steps.ops, 0
        for index, kind in enumerate(steps.kinds):
            if kind == ACTION_STEP:
                continue
            for at in range(steps.group_ends[group - 1] if group else 0, steps.group_ends[group]):
                key = ((ops.microbatches[at] * chunks + ops.chunks[at]) * 4 + ops.producer_ops[at]
                       if ops.microbatches[at] < schedule.microbatches
                       and ops.chunks[at] < chunks else -1)
                message = message_of[key] if key >= 0 else -1
                if message < 0:
                    return False
                peer, op_kind = ops.peers[at], ops.kinds[at]
                if op_kind == SEND:
                    if (messages.source[message] != stage or messages.destination[message] != peer
                            or sent[message]
                            or index < step_of[stage][messages.produced_at[message]]):
                        return False
                    sent[message] = 1
                    pair = (op_kind, ops.channels[at], stage, peer)
                else:
                    if (messages.destination[message] != stage or messages.source[message] != peer
                            or received[message]
                            or index > step_of[stage][messages.consumer_index[message]]):
                        return False
                    received[message] = 1
                    pair = (op_kind, ops.channels[at], peer, stage)
                queues.setdefault(pair, []).append(key)
            group += 1
    if sent.count(0) or received.count(0):
        return False
    return all(keys == queues.get((1 - kind, channel, source, destination))
               for (kind, channel, source, destination), keys in queues.items())


def _stalls(stages: list[PlanSteps]) -> bool:
    """Whether the plan stalls under NCCL's rules (the replay of ``validate_comm``)."""
    count = len(stages)
    index = [0] * count
    waiting = [0] * count  # unmatched ops of the group a stage is in
    posted: dict[int, int] = {}
    ready = deque(range(count))
    while ready:
        stage = ready.popleft()
        steps = stages[stage]
        kinds, ops, ends = steps.kinds, steps.ops, steps.group_ends
        at = index[stage]
        while at < len(kinds):
            kind = kinds[at]
            at += 1
            if kind == ACTION_STEP:
                continue
            group = steps.slots[at - 1]
            for op in range(ends[group - 1] if group else 0, ends[group]):
                peer, channel = ops.peers[op], ops.channels[op]
                source, destination = (stage, peer) if ops.kinds[op] == SEND else (peer, stage)
                pair = (channel * count + source) * count + destination
                mine, theirs = pair * 2 + ops.kinds[op], pair * 2 + 1 - ops.kinds[op]
                number = posted.get(mine, 0)
                posted[mine] = number + 1
                if number < posted.get(theirs, 0):
                    # Its partner was posted first, so the peer is blocked in that group.
                    waiting[peer] -= 1
                    if waiting[peer] == 0:
                        ready.append(peer)
                else:
                    waiting[stage] += 1
            if waiting[stage]:
                break
        index[stage] = at
    return any(waiting)
