"""The Transport protocol: how a stage's results reach other stages, as the comm plan says.

The executor walks one stage's part of a ``schedules.CommPlan``: compute
actions, and groups of point-to-point operations. At a group it hands the
transport the payloads to send and the receives to expect (``post``); when an
action needs a received payload it asks for it (``take``). A transport may do
less waiting than the plan allows (post a receive earlier, wait for it only at
``take``, let a send complete in the background), never more, and never reorder
a channel's messages: the plan is proven deadlock-free under the strictest rules
(NCCL's: tags ignored, per-channel order, a send completes only once its receive
is posted), so any transport that is at most that strict cannot hang.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from schedules import CommPlan, Group
from schedules.dependencies import ActionKey

Payload = Any  # any pytree of tensors (see pipeline.payloads.tree)


class Transport(Protocol):
    """One stage's end of the pipeline's communication."""

    def begin_step(self, plan: CommPlan, stage: int, call: int = 0) -> None:
        """Get ready for a step that runs ``plan.stages[stage]``; ``call`` is the Pipe call's
        stamp (``wire.call_stamp``) its messages carry and must arrive with."""

    def post(self, group: Group, outgoing: Mapping[ActionKey, Payload]) -> None:
        """Start the group's operations: send ``outgoing[op.key]`` for each send op,
        expect each receive op's payload."""

    def take(self, key: ActionKey) -> Payload:
        """The payload of a posted receive, waiting until it has arrived.

        Raises:
            PeerError: the peer failed, died, sent a corrupt message or timed out.
            PipelineAborted: another stage of this process failed.
        """

    def finish(self) -> None:
        """Wait until every message this step sent has been received."""

    def fail(self, origin: int, reason: str) -> None:
        """Tell the peers still owed a message that rank ``origin`` failed; best effort."""

    def close(self) -> None:
        """Release buffers and communicators; the transport is not used afterwards."""


class KeyedTransport:
    """A ``Transport`` built on keyed ``send(key, peer, payload)`` and ``receive(key, source)``:
    a group's sends go out at once, its receives are taken when an action needs them.

    Subclasses fill ``_sources`` (each received key's sending stage) in ``begin_step``.
    """

    _sources: dict[ActionKey, int]

    def send(self, key: ActionKey, destination: int, payload: Payload) -> None:
        raise NotImplementedError

    def receive(self, key: ActionKey, source: int) -> Payload:
        raise NotImplementedError

    def post(self, group: Group, outgoing: Mapping[ActionKey, Payload]) -> None:
        for op in group.ops:
            if op.kind == "send":
                self.send(op.key, op.peer, outgoing[op.key])

    def take(self, key: ActionKey) -> Payload:
        return self.receive(key, self._sources[key])
