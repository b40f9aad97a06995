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

    The loop runs once per action and per message (10^6 times at P=128, M=4096), so each
    instant's arrivals and departures are one call each, with the moves inlined: no call,
    no attribute look-up and no list made per action.
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
        # Each stage's moves as lists until the end (a list append is cheaper than an array's).
        self.gaps: list[list[int]] = [[] for _ in range(stages)]
        self.entries: list[list[int]] = [[] for _ in range(stages)]

    def run(self) -> list[Moves]:
        # Stages due at one instant wait in that instant's bucket, in the order they were
        # due (what a heap keyed by (time, tick) gave); the heap holds only distinct instants,
        # a few thousand pushes instead of one per action.
        buckets: dict[float, list[int]] = {0.0: list(range(len(self.lengths)))}
        instants = [0.0]
        while instants:
            now = heapq.heappop(instants)
            arrived = buckets.pop(now)
            # Everyone arriving at this instant is in a gap before anyone leaves.
            touched = self._arrive(arrived)
            self._leave(sorted(touched), now, buckets, instants)
        if not all(self.done):  # cannot happen for a validated schedule
            stuck = [stage for stage, done in enumerate(self.done) if not done]
            raise RuntimeError(f"comm_plan simulation stalled with stages {stuck} waiting")
        return [Moves.of_columns(gaps, entries) for gaps, entries in zip(self.gaps, self.entries)]

    def _arrive(self, arrived: list[int]) -> set[int]:
        """Put ``arrived`` in their gaps, each with the result of the action it just ran to
        send, then move every message between two stages in gaps that one of them touches;
        the stages that arrived or moved a message."""
        in_gap, position, pending, senders = self.in_gap, self.position, self.pending, self.senders
        out, destination_of = self.messages.out, self.messages.destination
        for stage in arrived:
            at = position[stage]
            if at:
                message = out[stage][at - 1]
                if message >= 0:
                    destination = destination_of[message]
                    pending[stage][destination].append(message)
                    senders[destination].add(stage)
            in_gap[stage] = True
        touched = set(arrived)
        gaps_of, entries_of, moved = self.gaps, self.entries, self.moved
        for stage in arrived:
            outgoing, incoming = pending[stage], senders[stage]
            # Moves from stage, then to it (a move changes no one's gap, so each peer can be
            # tested as it comes).
            if outgoing:
                at, gaps, entries = position[stage], gaps_of[stage], entries_of[stage]
                for peer in tuple(outgoing):
                    if in_gap[peer]:
                        peer_at, peer_gaps, peer_entries = position[peer], gaps_of[peer], \
                            entries_of[peer]
                        for message in outgoing.pop(peer):
                            gaps.append(at)
                            entries.append(2 * message)  # 2 * message + SEND
                            peer_gaps.append(peer_at)
                            peer_entries.append(2 * message + 1)  # 2 * message + RECEIVE
                            moved[message] = 1
                        senders[peer].discard(stage)
                        touched.add(peer)
            if incoming:
                at, gaps, entries = position[stage], gaps_of[stage], entries_of[stage]
                for peer in tuple(incoming):
                    if in_gap[peer]:
                        peer_at, peer_gaps, peer_entries = position[peer], gaps_of[peer], \
                            entries_of[peer]
                        for message in pending[peer].pop(stage):
                            peer_gaps.append(peer_at)
                            peer_entries.append(2 * message)  # 2 * message + SEND
                            gaps.append(at)
                            entries.append(2 * message + 1)  # 2 * message + RECEIVE
                            moved[message] = 1
                        incoming.discard(peer)
                        touched.add(peer)
        return touched

    def _leave(self, touched: list[int], now: float, buckets: dict[float, list[int]],
               instants: list[float]) -> None:
        """Start the next action of each stage of ``touched`` (in order) that is in a gap with
        its input there and no send to hold for, due back when it ends; mark finished ones."""
        in_gap, position, pending, busy_until = (
            self.in_gap, self.position, self.pending, self.busy_until)
        lengths, durations, needs, moved = (
            self.lengths, self.durations, self.messages.needs, self.moved)
        for stage in touched:
            if not in_gap[stage]:
                continue
            at, outgoing = position[stage], pending[stage]
            if at == lengths[stage]:
                if not outgoing:
                    self.done[stage], in_gap[stage] = True, False
                continue
            needed = needs[stage][at]
            if needed >= 0 and not moved[needed]:
                continue
            end = now + durations[stage][at]
            if outgoing and self._holds(outgoing, end):
                continue
            in_gap[stage] = False
            position[stage] = at + 1
            busy_until[stage] = end
            due = buckets.get(end)
            if due is None:
                buckets[end] = [stage]
                heapq.heappush(instants, end)
            else:
                due.append(stage)

    def _holds(self, outgoing: dict[int, list[int]], end: float) -> bool:
        """Whether a sender leaving now to be back at ``end`` should wait instead: a receiver
        of ``outgoing`` needs one of them next and is back before then."""
        consumer_index, busy_until, position = (
            self.messages.consumer_index, self.busy_until, self.position)
        for destination, messages in outgoing.items():
            if busy_until[destination] < end:
                next_index = position[destination]
                for message in messages:
                    if consumer_index[message] == next_index:
                        return True
        return False
