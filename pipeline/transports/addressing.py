"""How gloo messages are addressed: each message's tag, and a stage's routes in a comm plan
(its receives in order, its sends, each with its peer, channel and tags), resolved once per
plan."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from schedules import CommPlan, Op
from schedules.dependencies import ActionKey

_OP_CODES = {Op.F: 0, Op.B: 1, Op.I: 2, Op.W: 3}


def message_tag(key: ActionKey, chunks: int, second: bool) -> int:
    """The gloo tag of the message ``key``; ``second``: the full message that follows a
    notice of changed shapes (see ``transports.receive_ahead``)."""
    op, microbatch, chunk = key
    return ((microbatch * chunks + chunk) * 4 + _OP_CODES[op]) * 2 + int(second)


@dataclass(frozen=True)
class Route:
    """One message between this stage and ``peer``: the channel the plan puts it on and its
    gloo tags (``tag``; ``second_tag`` for the full message after a notice)."""

    key: ActionKey
    peer: int
    channel: int
    tag: int
    second_tag: int


@dataclass(frozen=True)
class StageRoutes:
    """One stage's routes in a comm plan, resolved once: its receives in the order of use,
    its sends, and every route by (key, peer stage)."""

    plan: CommPlan  # kept, so that its id is never reused while cached
    stage: int
    receives: tuple[Route, ...]
    sends: tuple[Route, ...]
    by_peer: dict[tuple[ActionKey, int], Route]

    def route(self, key: ActionKey, peer: int) -> Route:
        """The route of ``key`` between this stage and stage ``peer``.

        Raises:
            ValueError: the plan exchanges no such message with ``peer``.
        """
        found = self.by_peer.get((key, peer))
        if found is None:
            raise ValueError(f"stage {self.stage} has no {key[0].value}{key[1]}@c{key[2]} to "
                             f"exchange with stage {peer} in this step's comm plan")
        return found


def resolve_routes(plan: CommPlan, stage: int, chunks: int, known_channels: Collection[int]
                   ) -> StageRoutes:
    """``stage``'s routes in ``plan``, for a model of ``chunks`` chunks.

    Raises:
        ValueError: the plan puts a message of ``stage`` on a channel not in
            ``known_channels`` (those the transport has a process group for).
    """
    receives, sends = plan.receives(stage), plan.sends(stage)
    unknown = sorted({op.channel for op in (*receives, *sends)} - set(known_channels))
    if unknown:
        raise ValueError(
            f"the comm plan ({plan.strategy}) puts messages of stage {stage} on channel(s) "
            f"{unknown}, but the gloo transport has process groups for channels "
            f"{sorted(known_channels)} only")

    def route(key: ActionKey, peer: int, channel: int) -> Route:
        return Route(key, peer, channel, message_tag(key, chunks, False),
                     message_tag(key, chunks, True))

    incoming = tuple(route(op.key, op.peer, op.channel) for op in receives)
    outgoing = tuple(route(op.key, op.peer, op.channel) for op in sends)
    by_peer = {(found.key, found.peer): found for found in (*incoming, *outgoing)}
    return StageRoutes(plan, stage, incoming, outgoing, by_peer)
