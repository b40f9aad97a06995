"""OrderedTransport: the comm plan executed under NCCL's rules, on NCCL or, to check them, on gloo.

NCCL ignores tags: the n-th send on a communicator from A to B meets the n-th
receive there at B from A. So every channel of the plan gets communicators of
its own, and a group's operations are posted in the plan's order, batched per
communicator (``batch_isend_irecv``), in two rounds: first fixed-size headers
(each payload's structure, dtypes and shapes, on a header communicator beside
the channel's), then the payloads, whose receive buffers the headers sized.
Both rounds pair the same stages as the group itself, so they add no wait that
the plan's proof does not already cover. A header is bounds-checked before any
buffer is allocated for what it announces.

With ``rendezvous=True`` every send is also waited on before the stage moves
past its group. On gloo a send completes only when its receive has taken the
data, so the runtime then runs under the worst case NCCL allows (no eager
buffering): a plan or a runtime that could hang on a GPU cluster hangs here,
under a timeout, on a CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from schedules import CommOp, CommPlan, Group
from schedules.dependencies import ActionKey

from pipeline.errors import PeerError
from pipeline.payloads.tree import from_wire, to_wire
from pipeline.transports.base import Payload
from pipeline.transports.groups import destroy, pipeline_groups
from pipeline.transports.wire import (
    HEADER_SLOTS,
    MAX_MESSAGE_BYTES,
    BufferPool,
    HeaderError,
    check_announces,
    check_status,
    decode_header,
    encode_failure,
    encode_header,
    message_size,
    pack,
    unpack,
)


@dataclass(frozen=True)
class _Channel:
    data: dist.ProcessGroup  # one communicator for the channel's payloads
    header: dist.ProcessGroup  # and one for their headers


def channel_groups(group: dist.ProcessGroup, stage_ranks: Sequence[int],
                   channels: Sequence[int]) -> dict[int, _Channel]:
    """Two communicators per channel over the pipeline's ranks (``groups.pipeline_groups``)."""
    made = pipeline_groups(group, stage_ranks, 2 * len(channels))
    return {channel: _Channel(made[2 * index], made[2 * index + 1])
            for index, channel in enumerate(channels)}


class OrderedTransport:
    """Plan-ordered point-to-point messages, one pair of communicators per channel."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        stage_ranks: Sequence[int],
        stage: int,
        device: torch.device,
        channels: Sequence[int],
        timeout: float,
        rendezvous: bool,
    ) -> None:
        self.stage_ranks = list(stage_ranks)
        self.stage = stage
        self.device = device
        self.timeout = timeout
        self.rendezvous = rendezvous
        self.max_message_bytes = MAX_MESSAGE_BYTES
        self.channels = channel_groups(group, stage_ranks, channels)
        self.pool = BufferPool(device)
        self._received: dict[ActionKey, Payload] = {}
        self._in_flight: list[tuple[CommOp, Any, torch.Tensor]] = []  # posted, not yet waited on
        self._owed: list[CommOp] = []
        self._call = 0  # the stamp of the call under way (wire.call_stamp)
        self._checked: set[tuple[Any, int]] = set()  # (metas, kind) of headers checked

    def begin_step(self, plan: CommPlan, stage: int, call: int = 0) -> None:
        self._call = call  # stamped on every header sent, checked on every one received
        self._received = {}
        self._owed = list(plan.sends(stage))

    def post(self, group: Group, outgoing: Mapping[ActionKey, Payload]) -> None:
        sends = [op for op in group.ops if op.kind == "send"]
        receives = [op for op in group.ops if op.kind == "recv"]
        # A send needs nothing from its peer: header and payload leave together, so that no
        # send waits for a receive of the same group (the plan's ops progress independently).
        outbound: list[tuple[CommOp, torch.Tensor, bool]] = []
        for op in sends:
            kind, tensors = to_wire(outgoing[op.key])
            tensors = [t.to(self.device).contiguous() for t in tensors]
            metas = tuple((t.dtype, tuple(t.shape)) for t in tensors)
            header = encode_header(metas, kind, self._call)
            if (metas, kind) not in self._checked:  # once per distinct header
                check_announces(header, metas)
                self._checked.add((metas, kind))
            header = header.to(self.device)
            message = torch.empty(message_size(metas), dtype=torch.uint8, device=self.device)
            pack(header, tensors, message)
            outbound += [(op, header, True), (op, message, False)]
        headers = {op.key: torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.device)
                   for op in receives}
        self._post([*outbound, *((op, headers[op.key], True) for op in receives)])
        # Each payload's receive is posted once its header has said how large it is.
        for op in receives:
            self._wait_for([op])
            kind, metas = self._read_header(op, headers[op.key])
            buffer = self.pool.take(message_size(metas))
            self._post([(op, buffer, False)])
            self._wait_for([op])
            try:
                self._received[op.key] = from_wire(kind, unpack(buffer, metas))
            except Exception as error:
                raise self._corrupt(op, f"{type(error).__name__}: {error}") from error
        if self.rendezvous:
            self._wait_for(sends)
        done = {op.key for op in sends}
        self._owed = [op for op in self._owed if op.key not in done]

    def _post(self, items: list[tuple[CommOp, torch.Tensor, bool]]) -> None:
        """Post ``(op, tensor, is_header)`` items in order, batched per communicator."""
        batches: dict[int, list[Any]] = {}
        for op, tensor, is_header in items:
            channel = self.channels[op.channel]
            comm = channel.header if is_header else channel.data
            function = dist.isend if op.kind == "send" else dist.irecv
            batches.setdefault(id(comm), []).append(
                (op, tensor, dist.P2POp(function, tensor, self.stage_ranks[op.peer], group=comm))
            )
        for batch in batches.values():
            try:
                works = dist.batch_isend_irecv([p2p for _, _, p2p in batch])
            except RuntimeError as error:
                peers = sorted({self.stage_ranks[op.peer] for op, _, _ in batch})
                raise PeerError(f"stage {self.stage} could not post to rank(s) {peers}: {error}",
                                peers[0]) from error
            # The tensors stay referenced until their work is known to be done.
            self._in_flight.extend((op, work, tensor) for (op, tensor, _), work in zip(batch, works))

    def _wait_for(self, ops: list[CommOp]) -> None:
        """Wait for every posted operation of ``ops`` (all in flight, if ``ops`` is empty)."""
        wanted = {id(op) for op in ops}
        keep = []
        for op, work, tensor in self._in_flight:
            if ops and id(op) not in wanted:
                keep.append((op, work, tensor))
                continue
            try:
                work.wait(timedelta(seconds=self.timeout))
            except RuntimeError as error:
                rank = self.stage_ranks[op.peer]
                raise PeerError(
                    f"stage {self.stage} waited {self.timeout:g}s on [{op}] for rank {rank} "
                    f"(died, hung or too slow: raise Pipe(timeout=...)): {error}", rank
                ) from error
        self._in_flight = keep

    def _read_header(self, op: CommOp, header: torch.Tensor) -> tuple[int, Any]:
        header = header.cpu()
        try:
            check_status(header, self._call, self.stage, self.stage_ranks[op.peer],
                         self.stage_ranks[self.stage])
            return decode_header(header, self.max_message_bytes)
        except HeaderError as error:
            raise self._corrupt(op, str(error)) from error

    def _corrupt(self, op: CommOp, what: str) -> PeerError:
        rank = self.stage_ranks[op.peer]
        return PeerError(f"stage {self.stage} got a corrupt message ({op}) from rank {rank}: {what}",
                         rank)

    def take(self, key: ActionKey) -> Payload:
        return self._received.pop(key)

    def finish(self) -> None:
        self._wait_for([])

    def fail(self, origin: int, reason: str) -> None:
        """Send a failure header in place of the next message owed on each channel and peer."""
        failure = encode_failure(origin, reason).to(self.device)
        first: dict[tuple[int, int], CommOp] = {}
        for op in self._owed:
            first.setdefault((op.peer, op.channel), op)
        works = []
        for op in first.values():
            try:
                work = dist.isend(failure, self.stage_ranks[op.peer],
                                  group=self.channels[op.channel].header)
            except RuntimeError:
                continue  # that peer is gone already
            if work is not None:  # None only if this rank were outside the channel's group
                works.append(work)
        self._owed = []
        for work in works:
            try:
                work.wait(timedelta(seconds=min(self.timeout, 0.5)))
            except RuntimeError:
                pass

    def close(self) -> None:
        self._in_flight = []
        self._received = {}
        self.pool = BufferPool(self.device)
        destroy([comm for channel in self.channels.values() for comm in (channel.data, channel.header)])
        self.channels = {}
