"""DistTransport: results crossing ranks with torch.distributed point-to-point messages.

Every message is a small int64 header (status, origin rank, and the dtype and
shape of each tensor) followed by the tensors. Shapes may change from one
micro-batch to the next (variable sequence lengths); receive buffers are pooled
by dtype and shape and reused once nothing refers to them any more, so a steady
state allocates nothing. Sends never block (``isend``, waited at the end of the
step), and under gloo every header of the step is posted at its start, tagged by
the producing action, so no pair of neighbours can deadlock whatever the order.

Why payloads are posted ahead, under gloo: a gloo send whose receive is not yet
posted only announces itself; the bytes leave when the sender's gloo thread
hears that the receive is ready. Were the payload's receive posted only once its
header arrived, every hop would wait for that thread to be scheduled on a core
busy with the sender's next action: about a millisecond per hop, and in 1F1B
every hop is on the critical path. So both ends remember, per message, the
shapes it carried in the previous step; the receiver posts the payload's receive
a few messages ahead with those shapes, and the sender, making the same
prediction, knows it is posted. When the shapes differ the sender marks the
header "reshaped" and first sends zeros of the predicted shapes, which fill the
posted receives (gloo matches sends to receives in order), then the real
tensors; a message whose shapes just changed is not predicted in the next step,
so shapes that vary from step to step cost zeros once, then only the slower hop.
A rank that fails sends a header with status "failed" (and the error's text) in
place of each message it still owed, so its peers raise at once, naming it,
instead of waiting; they pass the news on the same way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from schedules import Op
from schedules.dependencies import ActionKey

HEADER_SLOTS = 4 + 8 * 10  # status, origin, is_tuple, count; then per tensor dtype, ndim, 8 dims
MAX_TENSORS = 8
MAX_DIMS = 8
_OK, _FAILED, _RESHAPED = 0, 1, 2
PAYLOAD_LOOKAHEAD = 4  # payload receives posted ahead of use, under gloo
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]
_OP_CODES = {Op.F: 0, Op.B: 1, Op.I: 2, Op.W: 3}


class PeerError(RuntimeError):
    """A peer rank failed, died or did not answer in time."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def _tag(key: ActionKey, chunks: int, part: int) -> int:
    op, microbatch, chunk = key
    return ((microbatch * chunks + chunk) * 4 + _OP_CODES[op]) * (MAX_TENSORS + 1) + part


def encode_header(tensors: Sequence[torch.Tensor], is_tuple: bool) -> torch.Tensor:
    """The header describing ``tensors``: their count, dtypes and shapes."""
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"a stage may pass at most {MAX_TENSORS} tensors, got {len(tensors)}")
    values = [_OK, 0, int(is_tuple), len(tensors)]
    for tensor in tensors:
        if tensor.dim() > MAX_DIMS or tensor.dtype not in _DTYPES:
            raise ValueError(
                f"tensors crossing stages need at most {MAX_DIMS} dims and a dtype in "
                f"{_DTYPES}, got {tensor.dtype} of shape {tuple(tensor.shape)}"
            )
        values += [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        values += [0] * (MAX_DIMS - tensor.dim())
    values += [0] * (HEADER_SLOTS - len(values))
    return torch.tensor(values, dtype=torch.int64)


def decode_header(header: torch.Tensor) -> tuple[bool, list[tuple[torch.dtype, tuple[int, ...]]]]:
    """``(is_tuple, [(dtype, shape), ...])`` from a header with status OK."""
    values = header.tolist()
    metas = []
    for index in range(values[3]):
        base = 4 + index * 10
        ndim = values[base + 1]
        metas.append((_DTYPES[values[base]], tuple(values[base + 2 : base + 2 + ndim])))
    return bool(values[2]), metas


def encode_failure(origin: int, reason: str) -> torch.Tensor:
    """A header that says rank ``origin`` failed, carrying as much of ``reason`` as fits."""
    header = torch.zeros(HEADER_SLOTS, dtype=torch.int64)
    text = reason.encode("utf-8", "replace")[: (HEADER_SLOTS - 4) * 8]
    padded = text + b" " * (-len(text) % 8)
    header[0], header[1], header[2] = _FAILED, origin, len(text)
    if padded:
        words = torch.frombuffer(bytearray(padded), dtype=torch.int64)
        header[4 : 4 + len(words)] = words
    return header


def decode_failure(header: torch.Tensor) -> tuple[int, str]:
    """``(origin rank, reason)`` from a failure header."""
    length = int(header[2])
    raw = header[4:].numpy().tobytes()[:length]
    return int(header[1]), raw.decode("utf-8", "replace")


class BufferPool:
    """Receive buffers by (dtype, shape, device), reused once no tensor shares their storage."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[tuple[torch.dtype, tuple[int, ...]], list[torch.Tensor]] = {}
        self.allocations = 0

    def take(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        pool = self._buffers.setdefault((dtype, shape), [])
        for buffer in pool:
            if _unshared(buffer):
                return buffer
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        self.allocations += 1
        pool.append(buffer)
        return buffer


def _unshared(buffer: torch.Tensor) -> bool:
    # The pool's own tensor and the temporary storage object make two uses; any
    # view handed out (and still alive) makes more.
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    return bool(use_count(buffer.untyped_storage()._cdata) <= 2)


Metas = tuple[tuple[torch.dtype, tuple[int, ...]], ...]
# (key, peer stage) -> (the shapes it last carried, whether they were the same as before)
Record = dict[tuple[ActionKey, int], tuple[Metas, bool]]


def _remember(record: Record, key: tuple[ActionKey, int], metas: Metas) -> None:
    previous = record.get(key)
    record[key] = (metas, previous is None or previous[0] == metas)


def _predicted(record: Record, key: tuple[ActionKey, int]) -> Metas | None:
    last = record.get(key)
    return last[0] if last is not None and last[1] else None


class DistTransport:
    """Point-to-point transport for one stage of a pipeline process group."""

    def __init__(
        self,
        group: Any,
        stage_ranks: Sequence[int],
        stage: int,
        device: torch.device,
        chunks: int,
        timeout: float,
    ) -> None:
        self.group = group
        self.stage_ranks = list(stage_ranks)  # global rank of each stage
        self.stage = stage
        self.device = device
        self.chunks = chunks
        self.timeout = timeout
        self.preposts = dist.get_backend(group) == "gloo"
        self.pool = BufferPool(device)
        self._headers: dict[ActionKey, tuple[torch.Tensor, Any]] = {}
        self._sends: list[tuple[Any, Any]] = []
        self._owed: dict[ActionKey, list[int]] = {}
        # What each message carried last step; both ends keep the same record, so they
        # make the same prediction (see the module docstring).
        self._sent_shapes: Record = {}
        self._received_shapes: Record = {}
        self._ahead: list[tuple[ActionKey, int, Metas]] = []  # predicted, not posted yet
        self._payloads: dict[ActionKey, tuple[list[torch.Tensor], list[Any]]] = {}

    def begin_step(
        self, receives: Sequence[tuple[ActionKey, int]], sends: dict[ActionKey, tuple[int, ...]]
    ) -> None:
        """Post this step's header receives (under gloo) and note the messages owed."""
        self._owed = {key: list(destinations) for key, destinations in sends.items()}
        self._headers = {}
        self._payloads = {}
        self._ahead = []
        if self.preposts:
            for key, source in receives:
                self._headers[key] = self._post_header(key, source)
                metas = _predicted(self._received_shapes, (key, source))
                if metas is not None:
                    self._ahead.append((key, source, metas))
            self._post_ahead()

    def _post_ahead(self) -> None:
        while self._ahead and len(self._payloads) < PAYLOAD_LOOKAHEAD:
            key, source, metas = self._ahead.pop(0)
            self._payloads[key] = self._post_payload(key, source, metas)

    def _post_payload(
        self, key: ActionKey, source: int, metas: Metas
    ) -> tuple[list[torch.Tensor], list[Any]]:
        # Views, not the pool's tensors: the pool counts views to know a buffer is taken.
        buffers = [self.pool.take(dtype, shape).detach() for dtype, shape in metas]
        peer = self.stage_ranks[source]
        operations = [
            dist.P2POp(dist.irecv, buffer, peer, self.group, _tag(key, self.chunks, part + 1))
            for part, buffer in enumerate(buffers)
        ]
        return buffers, list(dist.batch_isend_irecv(operations)) if operations else []

    def _post_header(self, key: ActionKey, source: int) -> tuple[torch.Tensor, Any]:
        header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self._wire_device())
        work = dist.irecv(header, self.stage_ranks[source], self.group, tag=_tag(key, self.chunks, 0))
        return header, work

    def _wire_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def send(self, key: ActionKey, destination: int, payload: Any) -> None:
        is_tuple = isinstance(payload, tuple)
        tensors = [t.contiguous() for t in (payload if is_tuple else (payload,))]
        header = encode_header(tensors, is_tuple)
        fillers: list[torch.Tensor] = []
        if self.preposts:
            metas = tuple((t.dtype, tuple(t.shape)) for t in tensors)
            predicted = _predicted(self._sent_shapes, (key, destination))
            _remember(self._sent_shapes, (key, destination), metas)
            if predicted is not None and predicted != metas:
                # The receive posted for the predicted shapes takes zeros; the tensors follow.
                header[0] = _RESHAPED
                fillers = [torch.zeros(shape, dtype=dtype, device=self.device)
                           for dtype, shape in predicted]
        header = header.to(self._wire_device())
        peer = self.stage_ranks[destination]
        operations = [dist.P2POp(dist.isend, header, peer, self.group, _tag(key, self.chunks, 0))]
        operations += [
            dist.P2POp(dist.isend, tensor, peer, self.group, _tag(key, self.chunks, part + 1))
            for batch in (fillers, tensors)
            for part, tensor in enumerate(batch)
        ]
        try:
            works = dist.batch_isend_irecv(operations)
        except RuntimeError as error:
            raise PeerError(
                f"stage {self.stage} could not send to rank {peer} (it died?): {error}", peer
            ) from error
        for work in works:
            self._sends.append((work, (header, tensors, fillers)))
        owed = self._owed.get(key)
        if owed is not None and destination in owed:
            owed.remove(destination)

    def receive(self, key: ActionKey, source: int) -> Any:
        header, work = self._headers.pop(key, None) or self._post_header(key, source)
        posted = self._payloads.pop(key, None)
        predicted = _predicted(self._received_shapes, (key, source)) if self.preposts else None
        if posted is None and predicted is not None:  # beyond the lookahead: post it now
            self._ahead = [entry for entry in self._ahead if entry[0] != key]
            posted = self._post_payload(key, source, predicted)
        self._wait(work, key, source)
        status = int(header[0])
        if status == _FAILED:
            origin, reason = decode_failure(header.cpu())
            raise PeerError(f"rank {origin} failed: {reason}; stage {self.stage} stops", origin)
        is_tuple, listed = decode_header(header.cpu())
        metas = tuple(listed)
        if self.preposts:
            _remember(self._received_shapes, (key, source), metas)
        if posted is not None:
            for work in posted[1]:  # the payload, or zeros when the shapes changed
                self._wait(work, key, source)
        if posted is None or status == _RESHAPED:
            posted = self._post_payload(key, source, metas)
            for work in posted[1]:
                self._wait(work, key, source)
        buffers = posted[0]
        self._post_ahead()
        views = tuple(buffer.detach() for buffer in buffers)
        return views if is_tuple else views[0]

    def _wait(self, work: Any, key: ActionKey, source: int) -> None:
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
                    f"{self.timeout:g}s: {error}", -1
                ) from error

    def fail(self, origin: int, reason: str) -> None:
        """Tell every peer still owed a message that ``origin`` failed; best effort."""
        header = encode_failure(origin, reason).to(self._wire_device())
        works = []
        for key, destinations in self._owed.items():
            for destination in destinations:
                peer = self.stage_ranks[destination]
                try:
                    works.append(dist.isend(header, peer, self.group, tag=_tag(key, self.chunks, 0)))
                except RuntimeError:
                    pass  # that peer is gone already
        self._owed = {}
        # After a failed step the two ends' records may differ: predict nothing from now on.
        self._sent_shapes.clear()
        self._received_shapes.clear()
        # Messages already under way go out first, so peers reach the failure headers.
        deadline = time.monotonic() + min(self.timeout, 10.0)
        pending, self._sends = [work for work, _ in self._sends], []
        for work in pending + works:
            try:
                work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except RuntimeError:
                pass
