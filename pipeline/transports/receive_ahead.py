"""The gloo receive, posted ahead: the shape predictions that size it, its budget, its read.

Why receives are posted ahead, under gloo: a gloo send whose receive is not yet
posted only announces itself; the bytes leave when the sender's gloo thread
hears that the receive is ready. Were a receive posted only once its data was
needed, every hop would wait for that thread to be scheduled on a core busy
with the sender's next action: about a millisecond per hop, and in 1F1B every
hop is on the critical path. But a receive needs its size, and the size comes
with the message. So both ends remember, per message, the shapes it carried in
the previous step; the receiver posts a few messages ahead with the predicted
size, and the sender, making the same prediction, sends exactly that size (a stage posts them
from its first wait on, in time it would idle anyway):

- shapes as predicted: the whole message, in one send;
- shapes changed, or nothing predicted (the first step, or shapes that changed
  in the step before): a message of the size the receiver expects (the predicted
  size, or a bare header when nothing is predicted) carrying only the header,
  with status "next", then the whole message under a second tag, which the
  receiver posts once the header has told it the size.

A message whose shapes just changed is not predicted in the next step, so shapes
that vary from step to step cost one extra small message per hop, never a wrong
read.

``ReceivesAhead`` owns everything a receive needs (the buffers' pool, the process
group of each channel, each message's route, the record of shapes, the header
reader), so that a receive runs here from the transport's ``take`` to the payload,
calling out (to the wire format, the payload's structure) and never back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from schedules.dependencies import ActionKey

from pipeline.errors import PeerError
from pipeline.payloads.tree import from_wire
from pipeline.transports.addressing import Route
from pipeline.transports.wire import (
    HEADER_BYTES,
    NEXT,
    BufferPool,
    HeaderError,
    MessageReader,
    Metas,
    message_size,
)

PAYLOAD_LOOKAHEAD = 4  # receives posted ahead of use, under gloo, at least
AHEAD_BYTES = 8 << 20  # and more while their buffers stay within this many bytes

# (key, peer stage) -> (the shapes it last carried, whether they were the same as before,
# the size of the message carrying them)
Record = dict[tuple[ActionKey, int], tuple[Metas, bool, int]]
Posted = tuple[torch.Tensor, Any]  # a posted receive's buffer and its gloo work


def remember(record: Record, key: tuple[ActionKey, int], metas: Metas) -> None:
    previous = record.get(key)
    if previous is not None and previous[0] == metas:
        record[key] = (metas, True, previous[2])
    else:
        record[key] = (metas, previous is None, message_size(metas))


def predicted(record: Record, key: tuple[ActionKey, int]) -> Metas | None:
    last = record.get(key)
    return last[0] if last is not None and last[1] else None


def expected_size(metas: Metas | None) -> int:
    """The size of the first message the receiver posts for: the predicted message, or a
    bare header when nothing is predicted."""
    return HEADER_BYTES if metas is None else message_size(metas)


def predicted_size(record: Record, key: tuple[ActionKey, int]) -> int:
    """``expected_size(predicted(record, key))``, from the size the record keeps."""
    last = record.get(key)
    return last[2] if last is not None and last[1] else HEADER_BYTES


class ReceivesAhead:
    """One stage's receives under gloo, in the order of use: posted ahead (``lookahead`` at
    least, more while their buffers stay within ``ahead_bytes``), waited for and read.

    Args:
        groups: the process group of each channel of the comm plan.
        stage_ranks: the global rank of each stage.
        stage: this stage.
        device: where receive buffers live.
        timeout: seconds a receive waits for its peer.
        predicts: post ahead, sized by the shapes of the step before (gloo); else every
            message is received as a notice and then the message, when it is needed.
    """

    def __init__(self, groups: Mapping[int, dist.ProcessGroup], stage_ranks: Sequence[int],
                 stage: int, device: torch.device, timeout: float, predicts: bool) -> None:
        self.groups = dict(groups)
        self.stage_ranks = list(stage_ranks)
        self.stage = stage
        self.device = device
        self.timeout = timeout
        self.predicts = predicts
        self.lookahead = PAYLOAD_LOOKAHEAD
        # Small messages are all posted at the step's start (measured on 2 cores: a 1F1B
        # step of tiny layers 14 -> 12.4 ms); large ones only ``lookahead`` at a time, so
        # that receive buffers stay bounded.
        self.ahead_bytes = AHEAD_BYTES
        self.pool = BufferPool(device)
        self.reader = MessageReader(stage, self.stage_ranks[stage])
        # What each message carried last step; the sender keeps the same record, so both
        # make the same prediction.
        self.record: Record = {}
        self.call = 0  # the stamp of the call under way (wire.call_stamp)
        self.routes: dict[ActionKey, Route] = {}
        self.pending: list[Route] = []  # still to post, in the order of use
        self.posted: dict[ActionKey, Posted] = {}
        self.posted_bytes = 0

    def start_step(self, receives: Sequence[Route], call: int) -> None:
        """Expect ``receives`` (in the order of use) during the call ``call``. They are posted
        from the first wait on (``_wait``), not here: a gloo receive costs its caller about
        0.15 ms, and here that would delay the stage's first action (the first stage's
        first forward, which starts the whole step: 1F1B of tiny layers on 2 cores,
        17.4 -> 15.7 ms a step)."""
        self.routes = {route.key: route for route in receives}
        self.pending = list(receives) if self.predicts else []
        self.posted = {}
        self.posted_bytes = 0
        self.call = call

    def take(self, key: ActionKey) -> Any:
        """The payload of ``key``, once it has arrived.

        Raises:
            PeerError: the peer failed, died, sent a corrupt message or timed out.
        """
        route = self.routes[key]
        posted = self._claim(key)
        if posted is None:
            posted = self._post(route, self._size(route), False)
        buffer, work = posted
        self._wait(work, route)
        try:
            status, kind, metas, tensors = self.reader.read(
                buffer, (key, route.peer), self.call, self.stage_ranks[route.peer])
            if status == NEXT:
                buffer, work = self._post(route, message_size(metas), True)
                self._wait(work, route)
                tensors = self.reader.view(buffer, metas)
        except HeaderError as error:
            raise self._corrupt(route, str(error)) from error
        if self.predicts:
            remember(self.record, (key, route.peer), metas)
        try:
            return from_wire(kind, tensors)
        except Exception as error:
            raise self._corrupt(route, f"{type(error).__name__}: {error}") from error

    def _size(self, route: Route) -> int:
        return predicted_size(self.record, (route.key, route.peer)) if self.predicts \
            else HEADER_BYTES

    def _post(self, route: Route, nbytes: int, second: bool) -> Posted:
        buffer = self.pool.take(nbytes)
        peer = self.stage_ranks[route.peer]
        try:
            return buffer, dist.irecv(buffer, peer, self.groups[route.channel],
                                      tag=route.second_tag if second else route.tag)
        except RuntimeError as error:
            raise PeerError(
                f"stage {self.stage} could not receive from rank {peer} (it died?): {error}", peer
            ) from error

    def _post_ahead(self) -> None:
        """Post the pending receives: ``lookahead`` of them at least, more while the posted
        buffers stay within ``ahead_bytes``."""
        while self.pending:
            route = self.pending[0]
            size = self._size(route)
            if len(self.posted) >= self.lookahead and self.posted_bytes + size > self.ahead_bytes:
                return
            self.pending.pop(0)
            self.posted[route.key] = self._post(route, size, False)
            self.posted_bytes += size

    def _claim(self, key: ActionKey) -> Posted | None:
        """The receive posted for ``key``, if any; otherwise ``key`` is no longer pending."""
        posted = self.posted.pop(key, None)
        if posted is not None:
            self.posted_bytes -= posted[0].numel()
        elif self.pending and self.pending[0].key == key:
            self.pending.pop(0)
        else:
            self.pending = [route for route in self.pending if route.key != key]
        return posted

    def _wait(self, work: Any, route: Route) -> None:
        # Post the next receives now, before waiting, not once the message is in: then
        # their cost (a message to the peer each) falls in this rank's idle time, not
        # between a message's arrival and the compute that needs it. (A gloo receive
        # cannot tell that it has completed before it is waited on.)
        self._post_ahead()
        try:
            work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as error:
            rank = self.stage_ranks[route.peer]
            key = route.key
            what = f"{key[0].value}{key[1]}@c{key[2]}"
            raise PeerError(
                f"stage {self.stage} got no {what} from rank {rank} within {self.timeout:g}s "
                f"(rank {rank} died, hung or is too slow: raise Pipe(timeout=...)): {error}",
                rank,
            ) from error

    def _corrupt(self, route: Route, what: str) -> PeerError:
        rank = self.stage_ranks[route.peer]
        return PeerError(f"stage {self.stage} got a corrupt message from rank {rank}: {what}", rank)

    def forget_shapes(self) -> None:
        """Predict nothing from now on (after a failed step the two ends' records may differ)."""
        self.record.clear()

    def close(self) -> None:
        """Drop every posted receive, buffer and process group."""
        self.posted, self.posted_bytes, self.pending = {}, 0, []
        self.pool = BufferPool(self.device)
        self.groups = {}
