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
of the predicted size (see ``transports.receive_ahead``, which owns the receiving end:
a receive goes from ``take`` there and never calls back here). A rank that fails sends,
in place of each message it still owed, one of the size the peer expects with
status "failed" and the error's text, so its peers raise at once, naming it,
instead of waiting; they pass the news on the same way.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from schedules import CommPlan, Group
from schedules.dependencies import ActionKey

from pipeline.errors import PeerError
from pipeline.payloads.tree import to_wire
from pipeline.transports.addressing import Route, StageRoutes, resolve_routes
from pipeline.transports.base import Payload
from pipeline.transports.groups import destroy, pipeline_groups
from pipeline.transports.receive_ahead import (
    ReceivesAhead,
    Record,
    expected_size,
    predicted,
    remember,
)
from pipeline.transports.wire import (
    BufferPool,
    Metas,
    check_announces,
    encode_header,
    failure_message,
    message_size,
    pack,
    stamp_header,
    write_notice,
)

FAILURE_GRACE = 0.5  # seconds a failing rank waits for its last messages to leave


class GlooTransport:
    """Point-to-point transport for one stage of a pipeline process group: the sends here,
    the receives in its ``ReceivesAhead``."""

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
        self.predicts = dist.get_backend(group) == "gloo"
        self.receives = ReceivesAhead(self.groups, stage_ranks, stage, device, timeout,
                                      self.predicts)
        self._call = 0  # the stamp of the call under way (wire.call_stamp)
        # Sharing cores with its peers, a rank yields after each send: the receiving thread
        # our send woke tends to be queued on this core, behind our next action, for a
        # scheduler tick (a few ms; measured on 2 cores, -3 to -6% on a 1F1B step).
        self.yield_after_send = device.type == "cpu" and hasattr(os, "sched_yield")
        self.send_pool = BufferPool(device)
        # Each distinct header, stamped with the call it last went out in: a send copies it
        # whole, the stamp written once per header and call, not into every message (three
        # tensor ops fewer a send: pack and stamp 0.26 -> 0.23-0.25 ms of CPU after a 25 ms
        # sleep, caches cold as between a pipeline's actions).
        self._headers: dict[tuple[Metas, int], tuple[torch.Tensor, list[int]]] = {}
        self._sends: list[tuple[Any, torch.Tensor]] = []  # in flight, with their buffers
        self._owed: dict[ActionKey, list[int]] = {}
        # What each message carried last step; the receiving end keeps the same record, so
        # both make the same prediction (see transports.receive_ahead).
        self._sent_shapes: Record = {}
        self._routes: StageRoutes | None = None  # this step's
        self._abandoned: list[tuple[Any, torch.Tensor]] = []  # a failed step's last sends
        self._known: dict[tuple[int, int], StageRoutes] = {}  # by (id of plan, stage)

    @property
    def pool(self) -> BufferPool:
        """The receive buffers."""
        return self.receives.pool

    def begin_step(self, plan: CommPlan, stage: int, call: int = 0) -> None:
        """Note this step's receives (to post ahead), the messages owed, each message's
        route, the call's stamp.

        Raises:
            ValueError: the plan puts a message of ``stage`` on a channel that this
                transport has no process group for.
        """
        self._call = call
        known = self._known.get((id(plan), stage))
        if known is None or known.plan is not plan:
            known = self._known[(id(plan), stage)] = resolve_routes(
                plan, stage, self.chunks, self.groups.keys())
        self._routes = known
        self._owed = {}
        for route in known.sends:
            self._owed.setdefault(route.key, []).append(route.peer)
        self.receives.start_step(known.receives, call)

    def post(self, group: Group, outgoing: Mapping[ActionKey, Payload]) -> None:
        """Send the group's sends at once; its receives are taken when an action needs them."""
        for op in group.ops:
            if op.kind == "send":
                self.send(op.key, op.peer, outgoing[op.key])

    def take(self, key: ActionKey) -> Payload:
        return self.receives.take(key)

    def close(self) -> None:
        """Wait briefly for what is still in flight, then drop every buffer."""
        for work, _ in self._sends + self._abandoned:
            try:
                work.wait(timedelta(seconds=FAILURE_GRACE))
            except RuntimeError:
                pass
        self._sends, self._abandoned = [], []
        self.receives.close()
        self.send_pool = BufferPool(self.device)
        destroy([group for channel, group in self.groups.items() if channel != 0])
        self.groups = {0: self.groups[0]}

    def _route(self, key: ActionKey, peer: int) -> Route:
        if self._routes is None:
            raise ValueError(f"stage {self.stage}: a message before begin_step()")
        return self._routes.route(key, peer)

    def _header(self, metas: Metas, kind: int) -> torch.Tensor:
        """The header of ``metas`` and ``kind``, stamped with this call."""
        known = self._headers.get((metas, kind))
        if known is None:
            # Kept and stamped in place by later calls, which may run outside the inference
            # mode this one runs in: made as a normal tensor (see BufferPool.take).
            with torch.inference_mode(False):
                written = encode_header(metas, kind)
                check_announces(written, metas)  # once per distinct header
                known = self._headers[(metas, kind)] = (written.to(self.device), [-1])
        header, stamped = known
        if stamped[0] != self._call:
            stamp_header(header, self._call)
            stamped[0] = self._call
        return header

    def send(self, key: ActionKey, destination: int, payload: Any) -> None:
        route = self._route(key, destination)
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
        pack(header, tensors, message)  # stamped with the call already
        if predicted_metas == metas:
            self._isend(route, message, False)
        else:
            # The size the receiver posted for carries only the header; the message follows.
            notice = self.send_pool.take(expected_size(predicted_metas))
            write_notice(notice, header, self._call)
            self._isend(route, notice, False)
            self._isend(route, message, True)
        owed = self._owed.get(key)
        if owed is not None and destination in owed:
            owed.remove(destination)

    def _isend(self, route: Route, buffer: torch.Tensor, second: bool) -> None:
        peer = self.stage_ranks[route.peer]
        try:
            work = dist.isend(buffer, peer, self.groups[route.channel],
                              tag=route.second_tag if second else route.tag)
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
                route = self._route(key, destination)
                try:
                    works.append((dist.isend(notice, peer, self.groups[route.channel],
                                             tag=route.tag), notice))
                except RuntimeError:
                    pass  # that peer is gone already
        self._owed = {}
        # After a failed step the two ends' records may differ: predict nothing from now on.
        self._sent_shapes.clear()
        self.receives.forget_shapes()
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
