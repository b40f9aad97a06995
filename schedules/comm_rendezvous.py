"""The rendezvous simulation behind ``comm_plan(strategy="overlap")``.

Stages run their actions with costs, and a message moves only while both of its stages
wait between actions (in a gap), as under NCCL's rules; the ops that moved in each gap
become that gap's group. Why that cannot deadlock is in ``schedules.comm``'s docstring.
Messages are numbers (``schedules.comm_messages``); nothing here is an object per action.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

from schedules.action import Schedule
from schedules.comm_messages import Messages, Moves
from schedules.plan_steps import RECEIVE, SEND

_UNIT = (1.0, 2.0, 1.0, 1.0)  # simulate's default cost of F, B, I, W (by op code)


def default_durations(schedule: Schedule) -> list[list[float]]:
    """Per stage and action, ``simulate``'s default cost: F 1, B 2, I and W 1 each, a stage's
    share split evenly between its chunks."""
    durations = []
    for order, chunks in zip(schedule.orders, schedule.chunks_of_stage):
        share = [unit / len(chunks) for unit in _UNIT]
        durations.append([share[code] for code in order.ops])
    return durations


class Rendezvous:
    """The simulation behind ``"overlap"``: stages run their actions with costs, and a
    message moves only while both of its stages wait between actions (in a gap).

    ``position[s]`` is the gap stage s is in, or, while it computes, the gap it will
    reach next (just after the action it runs). ``run`` returns, per stage and gap,
    the ops that moved there, in the order they moved, as each stage's ``Moves``.
    """

    def __init__(self, lengths: list[int], durations: list[list[float]],
                 messages: Messages) -> None:
        stages = len(lengths)
        self.lengths = lengths
        self.durations = durations
        self.messages = messages
        self.moved = bytearray(len(messages.producer))
        self.position = [0] * stages
        self.in_gap = [False] * stages
        self.done = [False] * stages
        self.busy_until = [0.0] * stages
        self.pending: list[dict[int, list[int]]] = [defaultdict(list) for _ in range(stages)]
        self.senders: list[set[int]] = [set() for _ in range(stages)]
        self.moves = [Moves() for _ in range(stages)]

    def run(self) -> list[Moves]:
        # Stages due at one instant wait in that instant's bucket, in the order they were
        # due (what a heap keyed by (time, tick) gave); the heap holds only distinct instants,
        # a few thousand pushes instead of one per action.
        buckets: dict[float, list[int]] = {0.0: list(range(len(self.lengths)))}
        instants = [0.0]
        in_gap, position = self.in_gap, self.position
        out, destination_of = self.messages.out, self.messages.destination
        pending, senders = self.pending, self.senders
        deliver, try_leave = self._deliver, self._try_leave
        while instants:
            now = heapq.heappop(instants)
            arrived = buckets.pop(now)
            for stage in arrived:
                # Arrive: the action just run has its result to send, if any.
                at = position[stage]
                message = out[stage][at - 1] if at else -1
                if message >= 0:
                    destination = destination_of[message]
                    pending[stage][destination].append(message)
                    senders[destination].add(stage)
                in_gap[stage] = True
            # Everyone arriving at this instant is in a gap before anyone leaves.
            touched = set(arrived)
            for stage in arrived:
                if senders[stage] or pending[stage]:
                    deliver(stage, touched)
            for stage in sorted(touched):
                if in_gap[stage]:
                    try_leave(stage, now, buckets, instants)
        if not all(self.done):  # cannot happen for a validated schedule
            stuck = [stage for stage, done in enumerate(self.done) if not done]
            raise RuntimeError(f"comm_plan simulation stalled with stages {stuck} waiting")
        return self.moves

    def _deliver(self, stage: int, touched: set[int]) -> None:
        """Move every message between ``stage`` and peers also in a gap; add them to touched."""
        in_gap, pending = self.in_gap, self.pending
        outgoing = pending[stage]
        for destination in [peer for peer in outgoing if in_gap[peer]]:
            self._move(stage, destination, outgoing.pop(destination))
            touched.add(destination)
        for source in [peer for peer in self.senders[stage] if in_gap[peer]]:
            self._move(source, stage, pending[source].pop(stage))
            touched.add(source)

    def _move(self, source: int, destination: int, messages: list[int]) -> None:
        sends, receives = self.moves[source], self.moves[destination]
        sent_at, received_at = self.position[source], self.position[destination]
        for message in messages:
            sends.gaps.append(sent_at)
            sends.entries.append(2 * message + SEND)
            receives.gaps.append(received_at)
            receives.entries.append(2 * message + RECEIVE)
            self.moved[message] = 1
        self.senders[destination].discard(source)

    def _try_leave(self, stage: int, now: float, buckets: dict[float, list[int]],
                   instants: list[float]) -> None:
        position, pending = self.position[stage], self.pending[stage]
        if position == self.lengths[stage]:
            if not pending:
                self.done[stage], self.in_gap[stage] = True, False
            return
        needed = self.messages.needs[stage][position]
        if needed >= 0 and not self.moved[needed]:
            return
        end = now + self.durations[stage][position]
        if pending:
            consumer_index, busy_until = self.messages.consumer_index, self.busy_until
            for destination, messages in pending.items():
                # Wait for a receiver that needs this next and arrives before we would be back.
                if busy_until[destination] < end:
                    next_index = self.position[destination]
                    for message in messages:
                        if consumer_index[message] == next_index:
                            return
        self.in_gap[stage] = False
        self.position[stage] = position + 1
        self.busy_until[stage] = end
        due = buckets.get(end)
        if due is None:
            buckets[end] = [stage]
            heapq.heappush(instants, end)
        else:
            due.append(stage)
