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
from schedules.plan_steps import ACTION_STEP, GROUP_STEP, SEND, PlanSteps


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
    source_of, destination_of = messages.source, messages.destination
    produced_at, consumer_index = messages.produced_at, messages.consumer_index
    microbatches = schedule.microbatches
    queues: dict[tuple[int, int, int, int], list[int]] = {}
    for stage, steps in enumerate(stages):
        ops, steps_of_actions = steps.ops, step_of[stage]
        for kind, peer, channel, code, microbatch, chunk, index in zip(
                ops.kinds, ops.peers, ops.channels, ops.producer_ops, ops.microbatches,
                ops.chunks, _op_steps(steps)):
            if microbatch >= microbatches or chunk >= chunks:
                return False
            key = (microbatch * chunks + chunk) * 4 + code
            message = message_of[key]
            if message < 0:
                return False
            if kind == SEND:
                if (source_of[message] != stage or destination_of[message] != peer
                        or sent[message] or index < steps_of_actions[produced_at[message]]):
                    return False
                sent[message] = 1
                pair = (kind, channel, stage, peer)
            else:
                if (destination_of[message] != stage or source_of[message] != peer
                        or received[message] or index > steps_of_actions[consumer_index[message]]):
                    return False
                received[message] = 1
                pair = (kind, channel, peer, stage)
            queue = queues.get(pair)
            if queue is None:
                queue = queues[pair] = []
            queue.append(key)
    if sent.count(0) or received.count(0):
        return False
    return all(keys == queues.get((1 - kind, channel, source, destination))
               for (kind, channel, source, destination), keys in queues.items())


def _op_steps(steps: PlanSteps) -> array[int]:
    """Per op of ``steps``, the index of the step (its group) that posts it."""
    at, start, found = 0, 0, array("q")
    for end in steps.group_ends:
        at = steps.kinds.index(GROUP_STEP, at)
        found.extend(array("q", [at]) * (end - start))
        start, at = end, at + 1
    return found


def _stalls(stages: list[PlanSteps]) -> bool:
    """Whether the plan stalls under NCCL's rules (the replay of ``validate_comm``)."""
    count = len(stages)
    index = [0] * count
    waiting = [0] * count  # unmatched ops of the group a stage is in
    posted = [0] * (2 * MAX_CHANNELS * count * count)
    ready = deque(range(count))
    while ready:
        stage = ready.popleft()
        steps = stages[stage]
        kinds, ends, slots = steps.kinds, steps.group_ends, steps.slots
        peers, channels, op_kinds = steps.ops.peers, steps.ops.channels, steps.ops.kinds
        at = index[stage]
        while True:
            at = kinds.find(GROUP_STEP, at)  # actions need nothing from other stages
            if at < 0:
                at = len(kinds)
                break
            group = slots[at]
            at += 1
            for op in range(ends[group - 1] if group else 0, ends[group]):
                peer, kind = peers[op], op_kinds[op]
                pair = (channels[op] * count + (stage if kind == SEND else peer)) * count + (
                    peer if kind == SEND else stage)
                mine, theirs = pair * 2 + kind, pair * 2 + 1 - kind
                number = posted[mine]
                posted[mine] = number + 1
                if number < posted[theirs]:
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
