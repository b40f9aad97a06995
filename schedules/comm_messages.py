"""The messages of a schedule as numbers: each result that crosses stages, once, by the rule
of ``schedules.flat``, with where it is produced and first needed.

A producer has at most one consumer on another stage (a forward's is the next chunk's
forward, a backward's the previous chunk's backward; its other consumers share its chunk),
so every action sends at most one message and needs at most one: ``out`` and ``needs`` hold
one message number per action, or -1.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from functools import cached_property

from schedules.action import CODE_F, CODE_W, Schedule
from schedules.comm_ops import ACTIVATIONS, GRADIENTS
from schedules.flat import Flat
from schedules.plan_steps import RECEIVE, SEND, OpArrays


@dataclass(frozen=True)
class Messages:
    """Columns, one entry per message, and per stage and action the message it sends/needs.

    Attributes:
        producer: the producing action's key (``schedules.flat``).
        source, produced_at: the producer's stage and its index there.
        destination, consumer_index: the stage that needs it and the index of its first
            action needing it.
        channel: ``ACTIVATIONS`` for a forward's result, ``GRADIENTS`` for a backward's.
        out: ``out[stage][index]``, the message the action there sends, or -1.
        needs: ``needs[stage][index]``, the message the action there needs first, or -1.
        chunks: the schedule's chunk count, to turn keys back into micro-batch and chunk.
    """

    producer: array[int]
    source: array[int]
    produced_at: array[int]
    destination: array[int]
    consumer_index: array[int]
    channel: array[int]
    out: list[array[int]]
    needs: list[array[int]]
    chunks: int

    @cached_property
    def _columns(self) -> tuple[list[int], ...]:
        """Lists (C-fast to gather from): by move entry (``Moves.entries``) the peer, the
        destination of a send and the source of a receive; by message its channel and its
        producer's op code, micro-batch and chunk."""
        peers = [0] * (2 * len(self.producer))
        peers[SEND::2], peers[RECEIVE::2] = self.destination, self.source
        units = list(map((2).__rrshift__, self.producer))  # key >> 2
        return (peers, self.channel.tolist(), list(map((3).__rand__, self.producer)),
                list(map(self.chunks.__rfloordiv__, units)),
                list(map(self.chunks.__rmod__, units)))

    def op_arrays(self, moves: Moves, channel: int | None = None) -> OpArrays:
        """The ops of ``moves``: a send at the message's source, a receive at its
        destination, on its channel or on ``channel`` (column by column, at C speed)."""
        ops = OpArrays()
        entries = moves.entries.tolist()  # ints made once, not once per pass
        peers, channels, codes, microbatches, chunks = self._columns
        messages = list(map((1).__rrshift__, entries))  # entry >> 1
        ops.kinds = bytearray(map((1).__rand__, entries))  # entry & 1
        ops.peers = array("q", map(peers.__getitem__, entries))
        ops.channels = (array("q", map(channels.__getitem__, messages))
                        if channel is None else array("q", [channel]) * len(entries))
        ops.producer_ops = bytearray(map(codes.__getitem__, messages))
        ops.microbatches = array("q", map(microbatches.__getitem__, messages))
        ops.chunks = array("q", map(chunks.__getitem__, messages))
        return ops


class Moves:
    """One stage's ops, in the order they are posted: per op, the gap it is posted in (the
    number of actions before it, never decreasing) and its entry, ``2 * message + kind``
    (kind ``SEND`` or ``RECEIVE``): two appends an op, for the rendezvous's inner loop."""

    __slots__ = ("gaps", "entries")

    def __init__(self) -> None:
        self.gaps, self.entries = array("q"), array("q")

    def add(self, gap: int, message: int, kind: int) -> None:
        self.gaps.append(gap)
        self.entries.append(2 * message + kind)

    @classmethod
    def of(cls, gaps: dict[int, list[tuple[int, int]]]) -> Moves:
        """The moves of ``gaps``: per gap, its ``(message, kind)`` ops in order."""
        moves = cls()
        for gap in sorted(gaps):
            for message, kind in gaps[gap]:
                moves.add(gap, message, kind)
        return moves


def find_messages(schedule: Schedule, flat: Flat) -> Messages:
    """Every cross-stage dependency of ``schedule`` (valid) as a message, in consumer order."""
    placement = schedule.placement
    chunks = schedule.chunks
    where = array("q", bytes(8 * flat.size))
    for keys in flat.keys:
        for index, key in enumerate(keys):
            where[key] = index
    columns: list[array[int]] = [array("q") for _ in range(6)]
    producer, source, produced_at, destination, consumer_index, channel = columns
    out = [array("q", [-1]) * len(keys) for keys in flat.keys]
    needs = [array("q", [-1]) * len(keys) for keys in flat.keys]
    for stage, order in enumerate(schedule.orders):
        first, second = flat.first[stage], flat.second[stage]
        for index, (code, chunk) in enumerate(zip(order.ops, order.chunks)):
            if code == CODE_F:
                if not chunk or placement[chunk - 1] == stage:
                    continue
                key, sender = first[index], placement[chunk - 1]
            elif code == CODE_W or second[index] < 0 or placement[chunk + 1] == stage:
                continue
            else:
                key, sender = second[index], placement[chunk + 1]
            at = where[key]
            message = len(producer)
            producer.append(key)
            source.append(sender)
            produced_at.append(at)
            destination.append(stage)
            consumer_index.append(index)
            channel.append(ACTIVATIONS if key & 3 == CODE_F else GRADIENTS)
            out[sender][at] = message
            needs[stage][index] = message
    return Messages(producer, source, produced_at, destination, consumer_index, channel, out,
                    needs, chunks)
