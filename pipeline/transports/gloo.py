"""GlooTransport: results crossing ranks with torch.distributed point-to-point messages.

It follows the comm plan's order, with gloo's freedoms: messages are matched
by tag, so receives are posted ahead of the plan (a few at a time, more while
their buffers fit in ``AHEAD_BYTES``) and sends never block; nothing waits
longer than the plan says, so it cannot deadlock.

A message is one flat byte buffer: a small int64 header (status, origin rank,
and the dtype and shape of each tensor), then each tensor's bytes (the format is
``pipeline.transports.wire``). One message per hop, whatever the number of tensors:
every gloo call costs the sender, the receiver and both ranks' gloo threads time on
cores the compute is using, so a hop that took a header message and a payload
message cost twice. Shapes may
change from one micro-batch to the next (variable sequence lengths); receive
buffers are pooled by size and reused once nothing refers to them any more, so
a steady state allocates nothing. Sends never block (``isend``), and a gloo send
whose receive is not posted yet simply waits in gloo, so no order of sends and
receives between two neighbours can deadlock.

Receives are posted ahead of use, sized by predicting each message's shapes from
the step before; a message whose shapes changed is announced first, in a message
of the predicted size (see ``transports.receive_ahead``). A rank that fails sends,
in place of each message it still owed, one of the size the peer expects with
status "failed" and the error's text, so its peers raise at once, naming it,
instead of waiting; they pass the news on the same way.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from schedules import CommPlan
from schedules.dependencies import ActionKey

from pipeline.payloads.tree import from_wire, to_wire
from pipeline.transports.addressing import StagePlan, message_tag, resolve_stage_plan
from pipeline.transports.base import KeyedTransport
from pipeline.errors import PeerError
from pipeline.transports.groups import destroy, pipeline_groups
from pipeline.transports.receive_ahead import (
    AHEAD_BYTES,
    PAYLOAD_LOOKAHEAD,
    Posted,
    ReceivesAhead,
    Record,
    expected_size,
    predicted,
    remember,
)
from pipeline.transports.wire import (
    MAX_MESSAGE_BYTES,
    NEXT,
    OK,
    HeaderError,
    BufferPool,
    Metas,
    check_announces,
    check_status,
    decode_header,
    encode_header,
    failure_message,
    header_of,
    message_size,
    pack,
    stamp_call,
    structure_bytes,
    unpack,
    write_notice,
)

FAILURE_GRACE = 0.5  # seconds a failing rank waits for its last messages to leave


class GlooTransport(KeyedTransport):
    """Point-to-point transport for one stage of a pipeline process group."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        stage_ranks: Sequence[int],
        stage: int,
        device: torch.device,
        chunks: int,
        timeout: float,
    ) -> None:
        # The process group of each channel of the comm plan: channel 0 is the pipeline's
        # group, channel 1 a second group over the same ranks. The plan decides which
        # message takes which channel (``CommOp.channel``); comm_plan puts gradients on a
        # channel of their own. On one group, messages both ways share each gloo pair and
        # its lock, which its I/O thread holds while it reads what arrives: in 1F1B, where
        # each send crosses an incoming message, a send cost its caller twice as much (tiny
        # layers on 2 cores: 0.45 -> 0.25 ms a send).
        self.groups: dict[int, dist.ProcessGroup] = {
            0: group, 1: pipeline_groups(group, stage_ranks, 1)[0]}
        self.stage_ranks = list(stage_ranks)  # global rank of each stage
        self.stage = stage
        self.device = device
        self.chunks = chunks
        self.timeout = timeout
        self.max_message_bytes = MAX_MESSAGE_BYTES
        self.predicts = dist.get_backend(group) == "gloo"
        self.lookahead = PAYLOAD_LOOKAHEAD
        # Small messages are all posted at the step's start (measured on 2 cores: a 1F1B
        # step of tiny layers 14 -> 12.4 ms); large ones only ``lookahead`` at a time, so
        # that receive buffers stay bounded.
        self.ahead_bytes = AHEAD_BYTES
        self._call = 0  # the stamp of the call under way (wire.call_stamp)
        # Sharing cores with its peers, a rank yields after each send: the receiving thread
        # our send woke tends to be queued on this core, behind our next action, for a
        # scheduler tick (a few ms; measured on 2 cores, -3 to -6% on a 1F1B step).
        self.yield_after_send = device.type == "cpu" and hasattr(os, "sched_yield")
        self.pool = BufferPool(device)  # receive buffers
        self.send_pool = BufferPool(device)
        self._headers: dict[tuple[Metas, int], torch.Tensor] = {}
        self._sends: list[tuple[Any, torch.Tensor]] = []  # in flight, with their buffers
        self._owed: dict[ActionKey, list[int]] = {}
        # What each message carried last step; both ends keep the same record, so they
        # make the same prediction (see transports.receive_ahead).
        self._sent_shapes: Record = {}
        self._received_shapes: Record = {}
        self._receives = ReceivesAhead()
        self._sources: dict[ActionKey, int] = {}
        self._channels: dict[tuple[ActionKey, int], int] = {}  # (key, peer stage) -> channel
        self._abandoned: list[tuple[Any, torch.Tensor]] = []  # a failed step's last sends
        self._plans: dict[tuple[int, int], StagePlan] = {}  # by (id of plan, stage)
        # The last header received per message, and what it decoded to: a header that
        # repeats byte for byte is not decoded (nor bounds-checked) again.
        self._decoded: dict[tuple[ActionKey, int], tuple[bytes, int, Metas]] = {}

    def begin_step(self, plan: CommPlan, stage: int, call: int = 0) -> None:
        """Note this step's receives (to post ahead), the messages owed, each message's
        channel, the call's stamp.

        Raises:
            ValueError: the plan puts a message of ``stage`` on a channel that this
                transport has no process group for.
        """
        self._call = call
        known = self._plans.get((id(plan), stage))
        if known is None or known.plan is not plan:
            known = self._plans[(id(plan), stage)] = resolve_stage_plan(
                plan, stage, self.groups.keys())
        receives, self._sources, self._channels = known.receives, known.sources, known.channels
        self._owed = {}
        for key, peer in known.sends:
            self._owed.setdefault(key, []).append(peer)
        # Posted from the first wait on (``_wait``), not here: a gloo receive costs its
        # caller about 0.15 ms, and here that would delay the stage's first action (the
        # first stage's first forward, which starts the whole step: 1F1B of tiny layers
        # on 2 cores, 17.4 -> 15.7 ms a step).
        self._receives.start_step(receives if self.predicts else ())

    def close(self) -> None:
        """Wait briefly for what is still in flight, then drop every buffer."""
        for work, _ in self._sends + self._abandoned:
            try:
                work.wait(timedelta(seconds=FAILURE_GRACE))
            except RuntimeError:
                pass
        self._sends, self._abandoned = [], []
        self._receives.drop_posted()
        self.pool = BufferPool(self.device)
        self.send_pool = BufferPool(self.device)
        destroy([group for channel, group in self.groups.items() if channel != 0])
        self.groups = {0: self.groups[0]}

    def _post_ahead(self) -> None:
        self._receives.post(self._post, self._expected_size, self.lookahead, self.ahead_bytes)

    def _expected_size(self, key: ActionKey, source: int) -> int:
        return expected_size(
            predicted(self._received_shapes, (key, source)) if self.predicts else None)

    def _post(self, key: ActionKey, source: int, nbytes: int, second: bool = False) -> Posted:
        buffer = self.pool.take(nbytes)
        peer = self.stage_ranks[source]
        try:
            return buffer, dist.irecv(buffer, peer, self._group_of(key, source),
                                      tag=message_tag(key, self.chunks, second))
        except RuntimeError as error:
            raise PeerError(
                f"stage {self.stage} could not receive from rank {peer} (it died?): {error}", peer
            ) from error

    def _group_of(self, key: ActionKey, peer: int) -> dist.ProcessGroup:
        """The process group of the channel that the plan gives the message ``key`` between
        this stage and stage ``peer``."""
        channel = self._channels.get((key, peer))
        if channel is None:
            raise ValueError(f"stage {self.stage} has no {key[0].value}{key[1]}@c{key[2]} to "
                             f"exchange with stage {peer} in this step's comm plan")
        return self.groups[channel]

    def _header(self, metas: Metas, kind: int) -> torch.Tensor:
        header = self._headers.get((metas, kind))
        if header is None:
            written = encode_header(metas, kind)
            check_announces(written, metas)  # once per distinct header
            with torch.inference_mode(False):  # kept for later calls (see BufferPool.take)
                header = written.to(self.device)
            self._headers[(metas, kind)] = header
        return header

    def send(self, key: ActionKey, destination: int, payload: Any) -> None:
        kind, tensors = to_wire(payload)
        tensors = [t.to(self.device).contiguous() for t in tensors]
        metas = tuple((t.dtype, tuple(t.shape)) for t in tensors)
        header = self._header(metas, kind)
        predicted_metas = None
        if self.predicts:
            predicted_metas = predicted(self._sent_shapes, (key, destination))
            remember(self._sent_shapes, (key, destination), metas)
        self._release_sent()
        message = self.send_pool.take(message_size(metas))
        pack(header, tensors, message)
        stamp_call(message, self._call)
        if predicted_metas == metas:
            self._isend(key, destination, message, False)
        else:
            # The size the receiver posted for carries only the header; the message follows.
            notice = self.send_pool.take(expected_size(predicted_metas))
            write_notice(notice, header, self._call)
            self._isend(key, destination, notice, False)
            self._isend(key, destination, message, True)
        owed = self._owed.get(key)
        if owed is not None and destination in owed:
            owed.remove(destination)

    def _isend(self, key: ActionKey, destination: int, buffer: torch.Tensor, second: bool) -> None:
        peer = self.stage_ranks[destination]
        try:
            work = dist.isend(buffer, peer, self._group_of(key, destination),
                              tag=message_tag(key, self.chunks, second))
        except RuntimeError as error:
            raise PeerError(
                f"stage {self.stage} could not send to rank {peer} (it died?): {error}", peer
            ) from error
        self._sends.append((work, buffer))
        if self.yield_after_send:
            os.sched_yield()

    def _release_sent(self) -> None:
        """Drop the buffers of sends already done, so that the send pool can reuse them.

        Under NCCL a send reports completion as soon as it has happened; a gloo send only
        once waited on, so under gloo the send buffers come back at ``finish``: a step
        holds a copy of each message it sent, as it used to hold the tensors themselves.
        """
        while self._sends and self._sends[0][0].is_completed():
            self._sends.pop(0)

    def receive(self, key: ActionKey, source: int) -> Any:
        posted = self._receives.claim(key)
        if posted is None:
            posted = self._post(key, source, self._expected_size(key, source), False)
        buffer, work = posted
        self._wait(work, key, source)
        header = header_of(buffer)
        try:
            status = check_status(header, self._call, self.stage, self.stage_ranks[source],
                                  self.stage_ranks[self.stage], (OK, NEXT))
        except HeaderError as error:
            raise self._corrupt(source, str(error)) from error
        kind, metas = self._decode(key, source, header)
        if status == NEXT:
            buffer, work = self._post(key, source, message_size(metas), True)
            self._wait(work, key, source)
        if self.predicts:
            remember(self._received_shapes, (key, source), metas)
        if buffer.numel() < message_size(metas):
            raise self._corrupt(source, f"{buffer.numel()} bytes arrived for a header "
                                        f"announcing {message_size(metas)}")
        tensors = unpack(buffer, metas)
        try:
            return from_wire(kind, tensors)
        except Exception as error:
            raise self._corrupt(source, f"{type(error).__name__}: {error}") from error

    def _decode(self, key: ActionKey, source: int, header: torch.Tensor) -> tuple[int, Metas]:
        """``decode_header``, skipped when the header is the one this message had last time."""
        raw = structure_bytes(header)  # the same every call
        last = self._decoded.get((key, source))
        if last is not None and last[0] == raw:
            return last[1], last[2]
        try:
            kind, metas = decode_header(header, self.max_message_bytes)
        except HeaderError as error:
            raise self._corrupt(source, str(error)) from error
        self._decoded[(key, source)] = (raw, kind, metas)
        return kind, metas

    def _corrupt(self, source: int, what: str) -> PeerError:
        rank = self.stage_ranks[source]
        return PeerError(f"stage {self.stage} got a corrupt message from rank {rank}: {what}", rank)

    def _wait(self, work: Any, key: ActionKey, source: int) -> None:
        # Post the next receives now, before waiting, not once the message is in: then
        # their cost (a message to the peer each) falls in this rank's idle time, not
        # between a message's arrival and the compute that needs it. (A gloo receive
        # cannot tell that it has completed before it is waited on.)
        self._post_ahead()
        try:
            work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as error:
            rank = self.stage_ranks[source]
            what = f"{key[0].value}{key[1]}@c{key[2]}"
            raise PeerError(
                f"stage {self.stage} got no {what} from rank {rank} within {self.timeout:g}s "
                f"(rank {rank} died, hung or is too slow: raise Pipe(timeout=...)): {error}",
                rank,
            ) from error

    def finish(self) -> None:
        """Wait until every message this step sent has been received."""
        sends, self._sends = self._sends, []
        deadline = time.monotonic() + self.timeout
        for work, _ in sends:
            try:
                work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except RuntimeError as error:
                raise PeerError(
                    f"stage {self.stage}: a peer did not take its messages within "
                    f"{self.timeout:g}s: {error}"
                ) from error

    def fail(self, origin: int, reason: str) -> None:
        """Tell every peer still owed a message that ``origin`` failed; best effort."""
        works = []
        for key, destinations in self._owed.items():
            for destination in destinations:
                predicted_metas = (predicted(self._sent_shapes, (key, destination))
                                   if self.predicts else None)
                notice = failure_message(origin, reason, expected_size(predicted_metas),
                                         self.device)
                peer = self.stage_ranks[destination]
                try:
                    works.append((dist.isend(notice, peer, self._group_of(key, destination),
                                             tag=message_tag(key, self.chunks, False)), notice))
                except RuntimeError:
                    pass  # that peer is gone already
        self._owed = {}
        # After a failed step the two ends' records may differ: predict nothing from now on.
        self._sent_shapes.clear()
        self._received_shapes.clear()
        # A peer blocked on one of these has its receive posted, so its message leaves at
        # once; the rest wait in gloo until their peer posts the receive, which a peer that
        # stopped never does. Kept alive for the later ones; waited on briefly for the first.
        self._abandoned = self._sends + works
        self._sends = []
        deadline = time.monotonic() + min(self.timeout, FAILURE_GRACE)
        for work, _ in self._abandoned:
            try:
                work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except RuntimeError:
                pass
