"""The messages of a schedule as numbers: each result that crosses stages, once, by the rule
of ``schedules.flat``, with where it is produced and first needed.

A producer has at most one consumer on another stage (a forward's is the next chunk's
forward, a backward's the previous chunk's backward; its other consumers share its chunk),
so every action sends at most one message and needs at most one: ``out`` and ``needs`` hold
one message number per action, or -1.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import repeat
from operator import itemgetter

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
        """Lists (C-fast to gather from), by move entry (``Moves.entries``, two per message):
        the peer (the destination of a send, the source of a receive), and the message's
        channel and its producer's op code, micro-batch and chunk."""
        units = list(map((2).__rrshift__, self.producer))  # key >> 2
        by_message = (self.channel.tolist(), list(map((3).__rand__, self.producer)),
                      list(map(self.chunks.__rfloordiv__, units)),
                      list(map(self.chunks.__rmod__, units)))
        columns = []
        for sent, received in [(self.destination, self.source)] + [(c, c) for c in by_message]:
            column = [0] * (2 * len(self.producer))
            column[SEND::2], column[RECEIVE::2] = sent, received
            columns.append(column)
        return tuple(columns)

    def op_arrays(self, moves: Moves, channel: int | None = None) -> OpArrays:
        """The ops of ``moves``: a send at the message's source, a receive at its
        destination, on its channel or on ``channel`` (column by column, at C speed)."""
        ops = OpArrays()
        entries = moves.entries.tolist()
        take = _gather(entries)
        peers, channels, codes, microbatches, chunks = self._columns
        low = moves.entries.tobytes()[:: 8] if sys.byteorder == "little" else \
            moves.entries.tobytes()[7:: 8]
        ops.kinds = bytearray(low.translate(_LOW_BIT))  # entry & 1, off the low bytes
        ops.peers = array("q", take(peers))
        ops.channels = (array("q", take(channels))
                        if channel is None else array("q", [channel]) * len(entries))
        ops.producer_ops = bytearray(take(codes))
        ops.microbatches = array("q", take(microbatches))
        ops.chunks = array("q", take(chunks))
        return ops


def _gather(entries: list[int]) -> Callable[[list[int]], Sequence[int]]:
    """A function taking ``column[entry]`` for each of ``entries``, in order: an itemgetter,
    one C call a column, half the time of ``map(column.__getitem__, entries)`` (zb-v P=64,
    M=1024: a plan's op columns 0.18 -> 0.09 s)."""
    if len(entries) > 1:
        return itemgetter(*entries)
    return lambda column: [column[entry] for entry in entries]  # itemgetter(x) is no tuple


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
    def of_columns(cls, gaps: list[int], entries: list[int]) -> Moves:
        """The moves with these gaps and entries, one each per op."""
        moves = cls()
        moves.gaps, moves.entries = array("q", gaps), array("q", entries)
        return moves

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
    where = array("q", bytes(8 * flat.size))  # per key, its index on its stage
    for keys in flat.keys:
        for index, key in enumerate(keys):
            where[key] = index
    producer: list[int] = []
    source: list[int] = []
    produced_at: list[int] = []
    destination: list[int] = []
    consumer_index: list[int] = []
    out = [array("q", [-1]) * len(keys) for keys in flat.keys]
    needs = [array("q", [-1]) * len(keys) for keys in flat.keys]
    message = 0
    for stage, order in enumerate(schedule.orders):
        first, second, needed = flat.first[stage], flat.second[stage], needs[stage]
        forward_from, backward_from = _senders(schedule.placement, stage)
        began, index = message, -1
        for code, chunk in zip(order.ops, order.chunks):
            index += 1
            if code == CODE_F:
                sender, key = forward_from[chunk], first[index]
            elif code == CODE_W:
                continue
            else:
                sender, key = backward_from[chunk], second[index]
            if sender < 0:
                continue
            at = where[key]
            out[sender][at] = needed[index] = message
            message += 1
            producer.append(key)
            source.append(sender)
            produced_at.append(at)
            consumer_index.append(index)
        destination.extend(repeat(stage, message - began))
    channel = map(_CHANNELS.__getitem__, map((3).__and__, producer))  # by producer op code
    return Messages(array("q", producer), array("q", source), array("q", produced_at),
                    array("q", destination), array("q", consumer_index), array("q", channel),
                    out, needs, schedule.chunks)


_LOW_BIT = bytes(byte & 1 for byte in range(256))
_CHANNELS = (ACTIVATIONS, GRADIENTS, GRADIENTS, GRADIENTS)  # by op code: F's result, gradients


def _senders(placement: tuple[int, ...], stage: int) -> tuple[list[int], list[int]]:
    """By chunk, the stage that sends a forward of ``stage`` its input (chunk c-1's) and the
    one that sends a B or I its gradient (chunk c+1's), or -1: none, or ``stage`` itself."""
    last = len(placement) - 1
    before = [placement[chunk - 1] if chunk else stage for chunk in range(last + 1)]
    after = [placement[chunk + 1] if chunk < last else stage for chunk in range(last + 1)]
    return ([-1 if other == stage else other for other in before],
            [-1 if other == stage else other for other in after])
