"""How gloo messages are addressed: each message's tag, and a stage's share of a comm plan
(its receives, its sends and the channel of each), resolved once per plan."""

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
class StagePlan:
    """One stage's part of a comm plan, resolved once: its receives in order (key, source),
    their sources, its sends (key, destination), and each message's channel, by
    (key, peer stage), as the plan sets it."""

    plan: CommPlan  # kept, so that its id is never reused while cached
    receives: tuple[tuple[ActionKey, int], ...]
    sources: dict[ActionKey, int]
    sends: tuple[tuple[ActionKey, int], ...]
    channels: dict[tuple[ActionKey, int], int]


def resolve_stage_plan(plan: CommPlan, stage: int, known_channels: Collection[int]) -> StagePlan:
    """``stage``'s part of ``plan``.

    Raises:
        ValueError: the plan puts a message of ``stage`` on a channel not in
            ``known_channels`` (those the transport has a process group for).
    """
    receives, sends = plan.receives(stage), plan.sends(stage)
    channels = {(op.key, op.peer): op.channel for op in (*receives, *sends)}
    unknown = sorted(set(channels.values()) - set(known_channels))
    if unknown:
        raise ValueError(
            f"the comm plan ({plan.strategy}) puts messages of stage {stage} on channel(s) "
            f"{unknown}, but the gloo transport has process groups for channels "
            f"{sorted(known_channels)} only")
    incoming = tuple((op.key, op.peer) for op in receives)
    return StagePlan(plan, incoming, dict(incoming),
                     tuple((op.key, op.peer) for op in sends), channels)
