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
    queues = _queues(schedule, stages)
    return queues is not None and not _stalls(stages, queues)


def _queues(schedule: Schedule, stages: list[PlanSteps]) -> list[array[int]] | None:
    """Per stage and op, its queue (``2 * pair + kind``, a pair being a channel, a source and
    a destination), if each message is sent once after its producer by its source, received
    once before its first use by its destination, and per pair sent and received in one
    order; else None."""
    flat = flatten(schedule)
    chunks, placement, count_ = schedule.chunks, schedule.placement, schedule.stages
    # Per key, its index on its stage, or -1: absent; four more -1s, so that a receive's
    # consumer looked up past either end of the keys (a key no send has) reads -1.
    where = array("q", [-1]) * (flat.size + 4)
    for keys in flat.keys:
        for index, key in enumerate(keys):
            where[key] = index
    # By key class (``key % span``: chunk and op code), the stage holding the producer and the
    # stage of its one consumer on another chunk (-1: none; a W's result never leaves).
    span = 4 * chunks
    producer = [placement[cls >> 2] for cls in range(span)]
    consumer = [-1] * span
    for chunk in range(chunks):
        if chunk + 1 < chunks:
            consumer[4 * chunk + CODE_F] = placement[chunk + 1]
        if chunk:
            consumer[4 * chunk + CODE_B] = consumer[4 * chunk + CODE_I] = placement[chunk - 1]
    block = 2 * count_ * count_  # queues per channel
    keys_in: list[list[int]] = [[] for _ in range(MAX_CHANNELS * block)]
    posted, queues = 0, []
    for stage, steps in enumerate(stages):
        ops = steps.ops
        # By key class, the peer a send of stage must name (-2: none may).
        send_to = [c if p == stage else -2 for p, c in zip(producer, consumer)]
        sends = [(stage * count_ + peer) * 2 for peer in range(count_)]  # queue, channel 0
        receives = [(peer * count_ + stage) * 2 + 1 for peer in range(count_)]
        action_steps = array("q", compress(count(), steps.kinds.translate(_ACTIONS)))
        posted += len(ops.kinds)
        queue_of = array("q")
        queues.append(queue_of)
        for kind, peer, channel, code, microbatch, chunk, step in zip(
                ops.kinds, ops.peers, ops.channels, ops.producer_ops, ops.microbatches,
                ops.chunks, _op_steps(steps)):
            key = (microbatch * chunks + chunk) * 4 + code
            if kind == SEND:
                at = where[key]
                if at < 0 or send_to[key % span] != peer or step < action_steps[at]:
                    return None  # no such producer, not ours to send there, or not yet made
                queue = channel * block + sends[peer]
            else:
                # Its first use: the next chunk's forward, or the previous chunk's backward
                # (B or I, whichever exists). Whether the message exists and comes from
                # ``peer`` is the matching's to find: its send is checked, and the receive
                # matches it only on the queue from the producer's stage to the consumer's.
                used = where[key + 4] if code == CODE_F else max(
                    where[key - code - 4 + CODE_B], where[key - code - 4 + CODE_I])
                if step > action_steps[used]:
                    return None
                queue = channel * block + receives[peer]
            keys_in[queue].append(key)
            queue_of.append(queue)
    crossings = sum(1 for chunk in range(chunks - 1) if placement[chunk] != placement[chunk + 1])
    messages = schedule.microbatches * crossings * (1 if schedule.forward_only else 2)
    # Per pair, the receives carry the sends' keys in the sends' order; as many distinct
    # messages sent as there are is every one, once, each received once.
    sent = set(chain.from_iterable(keys_in[::2]))
    right = posted == 2 * len(sent) == 2 * messages and keys_in[::2] == keys_in[1::2]
    return queues if right else None


def _op_steps(steps: PlanSteps) -> Iterator[int]:
    """Per op of ``steps``, the index of the step (its group) that posts it."""
    ends = steps.group_ends
    sizes = map(sub, ends, chain((0,), ends))
    return chain.from_iterable(map(repeat, compress(count(), steps.kinds), sizes))


def _stalls(stages: list[PlanSteps], queues: list[array[int]]) -> bool:
    """Whether the plan stalls under NCCL's rules (the replay of ``validate_comm``), its ops
    posted on ``queues`` (``_queues``); actions need nothing from other stages, so only the
    groups are replayed."""
    count_ = len(stages)
    group_of = [0] * count_  # the group each stage posts next
    waiting = [0] * count_  # unmatched ops of the group a stage is in
    posted = [0] * (2 * MAX_CHANNELS * count_ * count_)
    ready = deque(range(count_))
    while ready:
        stage = ready.popleft()
        ends, peers, queue_of = stages[stage].group_ends, stages[stage].ops.peers, queues[stage]
        first = group_of[stage]
        start = ends[first - 1] if first else 0
        for group in range(first, len(ends)):
            end = ends[group]
            for op in range(start, end):
                mine = queue_of[op]
                number = posted[mine]
                posted[mine] = number + 1
                if number < posted[mine ^ 1]:
                    # Its partner was posted first, so the peer is blocked in that group.
                    peer = peers[op]
                    waiting[peer] -= 1
                    if waiting[peer] == 0:
                        ready.append(peer)
                else:
                    waiting[stage] += 1
            start = end
            if waiting[stage]:
                group_of[stage] = group + 1  # posted: it goes on from the next one
                break
        else:
            group_of[stage] = len(ends)
    return any(waiting)
