"""The proof of ``validate_comm`` on a plan's arrays: complete, matched, and free of stalls
under NCCL's rules, in time linear in the steps and with no object per step.

It answers yes or no; on no, ``validate_comm`` replays the plan on its objects to name the
fault (the checks and their messages live there, once).

Each op is checked against the schedule's keys (``schedules.flat``), not against a list of
messages: a message is a producer whose one consumer on another stage is fixed by the rule
(a forward's is the next chunk's forward, a backward's the previous chunk's backward), so
an op is right when its producer exists, sits on the sending stage, and its consumer sits on
the receiving one. With each op seen once and as many sends and receives as the placement
has crossings per micro-batch, the ops are the messages, each once. Reading the keys
instead of rebuilding the messages (``find_messages``) took zb-v's proof at P=64, M=1024
from 1.9 to 1.43 s of CPU, at P=128, M=4096 from 16.0 to 11.7 s.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterator
from itertools import chain, compress, count, repeat
from operator import sub

from schedules.action import CODE_B, CODE_F, CODE_I, CODE_W, Schedule
from schedules.comm import CommPlan
from schedules.comm_ops import MAX_CHANNELS
from schedules.flat import flatten
from schedules.plan_steps import SEND, PlanSteps

_ACTIONS = bytes([1, 0]) + bytes(254)  # kinds.translate: 1 at each action step, 0 at a group


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
                          or max(ops.channels) >= MAX_CHANNELS
                          or min(ops.microbatches) < 0 or max(ops.microbatches)
                          >= schedule.microbatches or min(ops.chunks) < 0
                          or max(ops.chunks) >= schedule.chunks or max(ops.kinds) > 1
                          or max(ops.producer_ops) > CODE_W):
            return False
    return _messages_are_right(schedule, stages) and not _stalls(stages)


def _messages_are_right(schedule: Schedule, stages: list[PlanSteps]) -> bool:
    """Each message sent once after its producer by its source, received once before its
    first use by its destination, and per channel and pair sends and receives in one order."""
    flat = flatten(schedule)
    chunks, placement, count_ = schedule.chunks, schedule.placement, schedule.stages
    where = array("q", [-1]) * flat.size  # per key, its index on its stage, or -1: absent
    for keys in flat.keys:
        for index, key in enumerate(keys):
            where[key] = index
    # By op code and chunk: the stage of the one consumer on another chunk, or -1.
    after = [placement[chunk + 1] for chunk in range(chunks - 1)] + [-1]
    before = [-1] + [placement[chunk - 1] for chunk in range(1, chunks)]
    consumer_stage = {CODE_F: after, CODE_B: before, CODE_I: before, CODE_W: [-1] * chunks}
    consumers = [consumer_stage[code] for code in range(4)]
    seen = bytearray(2 * flat.size)  # per key and kind: posted already
    sends: list[list[int]] = [[] for _ in range(MAX_CHANNELS * count_ * count_)]
    receives: list[list[int]] = [[] for _ in range(MAX_CHANNELS * count_ * count_)]
    posted = 0
    for stage, steps in enumerate(stages):
        ops = steps.ops
        action_steps = array("q", compress(count(), steps.kinds.translate(_ACTIONS)))
        posted += len(ops.kinds)
        for kind, peer, channel, code, microbatch, chunk, step in zip(
                ops.kinds, ops.peers, ops.channels, ops.producer_ops, ops.microbatches,
                ops.chunks, _op_steps(steps)):
            key = (microbatch * chunks + chunk) * 4 + code
            at = where[key]
            if at < 0 or seen[2 * key + kind]:
                return False  # no such producer, or posted twice
            seen[2 * key + kind] = 1
            if kind == SEND:
                if (placement[chunk] != stage or consumers[code][chunk] != peer
                        or step < action_steps[at]):
                    return False
                sends[(channel * count_ + stage) * count_ + peer].append(key)
                continue
            if placement[chunk] != peer or consumers[code][chunk] != stage:
                return False
            if code == CODE_F:
                used = where[key + 4]  # the next chunk's forward
            else:  # the previous chunk's backward, B or I (one of them exists)
                base = key - code - 4
                used = where[base + CODE_B]
                if used < 0:
                    used = where[base + CODE_I]
            if step > action_steps[used]:
                return False
            receives[(channel * count_ + peer) * count_ + stage].append(key)
    crossings = sum(1 for chunk in range(chunks - 1) if placement[chunk] != placement[chunk + 1])
    messages = schedule.microbatches * crossings * (1 if schedule.forward_only else 2)
    # Each op a distinct message: as many sends and receives as messages is every one, once.
    return posted == 2 * messages and sends == receives and \
        sum(map(len, sends)) == messages


def _op_steps(steps: PlanSteps) -> Iterator[int]:
    """Per op of ``steps``, the index of the step (its group) that posts it."""
    ends = steps.group_ends
    sizes = map(sub, ends, chain((0,), ends))
    return chain.from_iterable(map(repeat, compress(count(), steps.kinds), sizes))


def _stalls(stages: list[PlanSteps]) -> bool:
    """Whether the plan stalls under NCCL's rules (the replay of ``validate_comm``)."""
    count_ = len(stages)
    index = [0] * count_  # the step each stage is at
    group_of = [0] * count_  # the group it posts next
    waiting = [0] * count_  # unmatched ops of the group a stage is in
    posted = [0] * (2 * MAX_CHANNELS * count_ * count_)
    ready = deque(range(count_))
    while ready:
        stage = ready.popleft()
        steps = stages[stage]
        kinds, ends = steps.kinds, steps.group_ends
        peers, channels, op_kinds = steps.ops.peers, steps.ops.channels, steps.ops.kinds
        at, group = index[stage], group_of[stage]
        while True:
            at = kinds.find(1, at)  # a group (actions need nothing from other stages)
            if at < 0:
                at = len(kinds)
                break
            at += 1
            for op in range(ends[group - 1] if group else 0, ends[group]):
                peer, kind = peers[op], op_kinds[op]
                pair = (channels[op] * count_ + (stage if kind == SEND else peer)) * count_ + (
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
            group += 1
            if waiting[stage]:
                break
        index[stage], group_of[stage] = at, group
    return any(waiting)
