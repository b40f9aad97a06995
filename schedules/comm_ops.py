"""What moves between stages: a message (a result crossing stages once), the send or receive
of it (``CommOp``), and the operations posted together (``Group``).

``comm_plan`` derives them, ``comm_rendezvous`` simulates them under NCCL's rules and
``comm_validate`` checks them; all three read this vocabulary, none of them the others'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from schedules._speed import OP_F
from schedules.action import Action
from schedules.dependencies import ActionKey

Kind = Literal["send", "recv"]
MAX_CHANNELS = 4  # communicators a runtime may create for one pipeline
ACTIVATIONS, GRADIENTS = 0, 1  # the channels comm_plan uses


@dataclass(frozen=True)
class CommOp:
    """One point-to-point operation: send ``producer``'s result to ``peer``, or receive it.

    Attributes:
        kind: ``"send"`` or ``"recv"``.
        peer: the other stage.
        producer: the action whose result moves (an activation for ``F``, an input
            gradient for ``B`` or ``I``).
        channel: the communicator, 0..3; messages match in order per channel and pair.
    """

    kind: Kind
    peer: int
    producer: Action
    channel: int = 0

    @property
    def key(self) -> ActionKey:
        """The producer as an ``(op, microbatch, chunk)`` key, as the runtime files payloads."""
        return (self.producer.op, self.producer.microbatch, self.producer.chunk)

    def __str__(self) -> str:
        arrow = "->" if self.kind == "send" else "<-"
        suffix = f" ch{self.channel}" if self.channel else ""
        return f"{self.kind} {self.producer} {arrow} {self.peer}{suffix}"

    def __repr__(self) -> str:
        return str(self)


@dataclass(frozen=True)
class Group:
    """Operations posted together (one ``batch_isend_irecv`` per channel); a stage moves on
    only when all of them have completed."""

    ops: tuple[CommOp, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        if not self.ops:
            raise ValueError("a Group needs at least one op, got none")

    def batches(self) -> tuple[tuple[int, tuple[CommOp, ...]], ...]:
        """``(channel, ops)`` per channel, in first-use order: one batch each to post."""
        by_channel: dict[int, list[CommOp]] = {}
        for op in self.ops:
            by_channel.setdefault(op.channel, []).append(op)
        return tuple((channel, tuple(ops)) for channel, ops in by_channel.items())

    def __str__(self) -> str:
        return "[" + ", ".join(str(op) for op in self.ops) + "]"

    def __repr__(self) -> str:
        return str(self)


class Message:
    """A result crossing stages once: the action at ``(source, produced_at)`` in the
    schedule's order, sent to ``destination``, where the action at ``consumer_index``
    needs it first. Internal and mutable: ``moved`` is the simulation's flag."""

    __slots__ = ("producer", "source", "produced_at", "destination", "consumer_index",
                 "channel", "moved")

    def __init__(self, producer: Action, source: int, produced_at: int, destination: int,
                 consumer_index: int) -> None:
        self.producer, self.source, self.produced_at = producer, source, produced_at
        self.destination, self.consumer_index = destination, consumer_index
        self.channel = ACTIVATIONS if producer.op is OP_F else GRADIENTS
        self.moved = False

    def op(self, kind: Kind, channel: int | None = None) -> CommOp:
        peer = self.destination if kind == "send" else self.source
        return CommOp(kind, peer, self.producer, self.channel if channel is None else channel)
