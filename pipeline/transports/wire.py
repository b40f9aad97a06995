"""The wire format of the distributed transports: headers, and tensors packed into one buffer.

A message is a small int64 header (status, the sender's call, or the origin rank of a
failure; the payload's kind: one
tensor, a tuple of tensors, or any other structure, whose shape and non-tensor
leaves then travel as a last uint8 "tensor"; and the dtype and shape of each
tensor), then each tensor's bytes, each
starting at a multiple of ``ALIGNMENT`` so that the receiver's tensors are views
of the buffer. A failure's header carries the error's text instead of shapes.
``BufferPool`` keeps the buffers, by size, for reuse.

Headers are written and read here only: the transports build them
(``encode_header``, ``encode_failure``, ``write_notice``, ``failure_message``) and
check them (``check_status``, ``decode_header``, or a ``MessageReader`` that does both
and views the tensors, in one call) through these functions and never touch a slot
themselves.

Every field read from a header is checked against its bounds (``HeaderError``):
a corrupt or hostile header must not allocate terabytes or read past its message. A
header written is checked too (``check_announces``): a message larger than its header
announces would abort its receiver inside gloo, where no check of the receiver's runs.

Every message says which call of its Pipe sent it (``stamp_call``): the n-th call
(``step``, ``pipe(x)``) of the sender and whether it trains. A receiver in another
call (a validation pass that one rank ran alone) refuses the message
(``check_call``) instead of training on another call's activations.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence

import torch

from pipeline.errors import PeerError
from pipeline.payloads.tree import STRUCTURED, TENSOR, TUPLE

MAX_TENSORS = 16
MAX_DIMS = 8
MAX_MESSAGE_BYTES = 16 << 30  # what a header may announce, at most (16 GiB)
HEADER_SLOTS = 4 + MAX_TENSORS * (2 + MAX_DIMS)  # status, origin, kind, count; per tensor
HEADER_BYTES = HEADER_SLOTS * 8
ALIGNMENT = 16  # every tensor starts at a multiple of the largest element size
OK, FAILED, NEXT = 0, 1, 2  # a message's status
STATUS_SLOT, CALL_SLOT = 0, 1  # CALL_SLOT: an OK or NEXT header's call; a failure's origin rank
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]

Metas = tuple[tuple[torch.dtype, tuple[int, ...]], ...]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize


def message_size(metas: Metas) -> int:
    """Bytes of the message carrying tensors of these (dtype, shape)s, header included."""
    return HEADER_BYTES + sum(_aligned(_nbytes(dtype, shape)) for dtype, shape in metas)


class HeaderError(ValueError):
    """A header that no sender of this format writes: corrupt, truncated or hostile."""


def encode_header(metas: Metas, kind: int, stamp: int = 0) -> torch.Tensor:
    """The header describing tensors of these (dtype, shape)s, for a payload of ``kind``,
    sent during the call ``stamp`` (``call_stamp``; or stamped later with ``stamp_call``)."""
    if len(metas) > MAX_TENSORS:
        # A structured payload's shape takes a slot of its own: count what the user passed.
        extra = int(kind == STRUCTURED)
        raise ValueError(
            f"a stage may pass at most {MAX_TENSORS - extra} tensors"
            f"{' in a structure (its shape travels in one more slot)' if extra else ''}, "
            f"got {len(metas) - extra}")
    values = [OK, stamp, int(kind), len(metas)]
    for dtype, shape in metas:
        if len(shape) > MAX_DIMS or dtype not in _DTYPES:
            raise ValueError(
                f"tensors crossing stages need at most {MAX_DIMS} dims and a dtype in "
                f"{_DTYPES}, got {dtype} of shape {shape}"
            )
        values += [_DTYPES.index(dtype), len(shape), *shape]
        values += [0] * (MAX_DIMS - len(shape))
    values += [0] * (HEADER_SLOTS - len(values))
    return torch.tensor(values, dtype=torch.int64)


def decode_header(header: torch.Tensor, limit: int = MAX_MESSAGE_BYTES) -> tuple[int, Metas]:
    """``(kind, ((dtype, shape), ...))`` from a header with status OK or NEXT.

    Raises:
        HeaderError: a field out of its bounds (kind, count, dtype, dimensions, a size
            below zero, or a message larger than ``limit`` bytes).
    """
    values = header.tolist()
    if len(values) < HEADER_SLOTS:
        raise HeaderError(f"a header has {HEADER_SLOTS} slots, got {len(values)}")
    kind, count = values[2], values[3]
    if kind not in (TENSOR, TUPLE, STRUCTURED):
        raise HeaderError(f"payload kind must be 0, 1 or 2, got {kind}")
    if not 1 <= count <= MAX_TENSORS:
        raise HeaderError(f"tensor count must be in 1..{MAX_TENSORS}, got {count}")
    metas = []
    for index in range(count):
        base = 4 + index * (2 + MAX_DIMS)
        dtype_index, ndim = values[base], values[base + 1]
        if not 0 <= dtype_index < len(_DTYPES):
            raise HeaderError(f"dtype index must be in 0..{len(_DTYPES) - 1}, got {dtype_index}")
        if not 0 <= ndim <= MAX_DIMS:
            raise HeaderError(f"a tensor has 0..{MAX_DIMS} dimensions, got {ndim}")
        shape = tuple(values[base + 2 : base + 2 + ndim])
        if any(size < 0 or size > limit for size in shape):
            raise HeaderError(f"sizes must be in 0..{limit}, got shape {shape}")
        metas.append((_DTYPES[dtype_index], shape))
    size = message_size(tuple(metas))
    if size > limit:
        raise HeaderError(f"the header announces {size} bytes, more than the limit of {limit}")
    return kind, tuple(metas)


def check_announces(header: torch.Tensor, metas: Metas) -> None:
    """Refuse a (CPU) header that announces another size than the message of ``metas``
    it heads, before gloo sends either: the receiver posts the size a header announces,
    and gloo aborts the receiving process (in its own I/O thread, before a byte reaches
    any check of ours) when more arrives than was posted; when less arrives, the rest of
    the buffer is stale. A receiver cannot guard against this: the sender must.

    Raises:
        HeaderError: the sizes differ (a header written wrong, never a peer's fault).
    """
    _, announced = decode_header(header)
    if message_size(announced) != message_size(metas):
        raise HeaderError(
            f"refused to send a message of {message_size(metas)} bytes whose header announces "
            f"{message_size(announced)} (tensors {[tuple(shape) for _, shape in metas]}, "
            f"announced {[tuple(shape) for _, shape in announced]}): its receiver would post "
            f"the announced size, and gloo aborts a process that receives more")


def call_stamp(count: int, training: bool) -> int:
    """The stamp of a Pipe's ``count``-th call (counted on every rank alike)."""
    return 2 * count + int(training)


def describe_call(stamp: int) -> str:
    return f"call {stamp // 2} ({'a training step' if stamp % 2 else 'an inference call'})"


def stamp_call(buffer: torch.Tensor, stamp: int) -> None:
    """Write ``stamp`` into the header at the start of the uint8 ``buffer``."""
    buffer[8 * CALL_SLOT: 8 * CALL_SLOT + 8].view(torch.int64).fill_(stamp)


def stamp_header(header: torch.Tensor, stamp: int) -> None:
    """Write ``stamp`` into the int64 ``header`` (as ``stamp_call`` into a message)."""
    header[CALL_SLOT] = stamp


def header_of(message: torch.Tensor) -> torch.Tensor:
    """The header at the start of the uint8 ``message``, on the CPU (a view of it there)."""
    return message[:HEADER_BYTES].view(torch.int64).cpu()


def structure_bytes(header: torch.Tensor) -> bytes:
    """What a (CPU) header says of its payload (kind, count, each tensor's dtype and shape)
    as bytes, its status and call left out: headers with equal bytes decode alike."""
    return header[CALL_SLOT + 1:].numpy().tobytes()


def write_notice(buffer: torch.Tensor, header: torch.Tensor, stamp: int) -> None:
    """Write into the uint8 ``buffer`` the notice "size changed, the message follows":
    the message's own ``header`` with status NEXT, sent during the call ``stamp``."""
    pack(header, (), buffer)
    buffer[8 * STATUS_SLOT: 8 * STATUS_SLOT + 8].view(torch.int64).fill_(NEXT)
    stamp_call(buffer, stamp)


def check_status(header: torch.Tensor, call: int, stage: int, sender: int, receiver: int,
                 statuses: Collection[int] = (OK,)) -> int:
    """The status of a (CPU) header that rank ``sender`` sent to stage ``stage`` (on rank
    ``receiver``) during its call ``call``: one of ``statuses``.

    Raises:
        PeerError: the header is a failure's (naming the rank that failed, and why), or the
            message was sent during another call than ``call`` (see ``check_call``).
        HeaderError: a status outside ``statuses``.
    """
    status = int(header[STATUS_SLOT])
    if status == FAILED:
        origin, reason = decode_failure(header)
        raise PeerError(f"rank {origin} failed: {reason}; stage {stage} stops", origin)
    if status not in statuses:
        raise HeaderError(f"status {status}")
    mismatch = check_call(header, call, stage, sender)
    if mismatch is not None:
        raise PeerError(mismatch, receiver)
    return status


def check_call(header: torch.Tensor, expected: int, stage: int, rank: int) -> str | None:
    """Why a message with this (CPU) header cannot belong to the receiver's call, or None."""
    stamp = int(header[CALL_SLOT])
    if stamp == expected:
        return None
    return (f"stage {stage} received, during its {describe_call(expected)}, a message that "
            f"rank {rank} sent during its {describe_call(stamp)}: the ranks made different "
            f"calls (every rank must call step() and pipe(x) alike; a validation pass on one "
            f"rank only?)")


def encode_failure(origin: int, reason: str) -> torch.Tensor:
    """A header that says rank ``origin`` failed, carrying as much of ``reason`` as fits."""
    header = torch.zeros(HEADER_SLOTS, dtype=torch.int64)
    text = reason.encode("utf-8", "replace")[: (HEADER_SLOTS - 4) * 8]
    padded = text + b" " * (-len(text) % 8)
    header[STATUS_SLOT], header[CALL_SLOT], header[2] = FAILED, origin, len(text)
    if padded:
        words = torch.frombuffer(bytearray(padded), dtype=torch.int64)
        header[4 : 4 + len(words)] = words
    return header


def failure_message(origin: int, reason: str, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 message of ``nbytes`` (at least ``HEADER_BYTES``; the size its receiver
    expects) that says rank ``origin`` failed: ``encode_failure``'s header, then zeros."""
    message = torch.zeros(max(nbytes, HEADER_BYTES), dtype=torch.uint8, device=device)
    pack(encode_failure(origin, reason), (), message)
    return message


def decode_failure(header: torch.Tensor) -> tuple[int, str]:
    """``(origin rank, reason)`` from a failure header (text cut to what the header holds)."""
    length = max(0, min(int(header[2]), (HEADER_SLOTS - 4) * 8))
    raw = header[4:].numpy().tobytes()[:length]
    return int(header[CALL_SLOT]), raw.decode("utf-8", "replace")


def pack(header: torch.Tensor, tensors: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
    """Write ``header`` then each tensor's bytes into the flat uint8 ``buffer``."""
    buffer[:HEADER_BYTES].view(torch.int64).copy_(header)
    offset = HEADER_BYTES
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            buffer[offset : offset + nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
        offset += _aligned(nbytes)


def unpack(buffer: torch.Tensor, metas: Metas) -> tuple[torch.Tensor, ...]:
    """Views of ``buffer`` as the tensors that ``pack`` wrote into it."""
    tensors = []
    offset = HEADER_BYTES
    for dtype, shape in metas:
        nbytes = _nbytes(dtype, shape)
        tensors.append(buffer[offset : offset + nbytes].view(dtype).view(shape))
        offset += _aligned(nbytes)
    return tuple(tensors)


class MessageReader:
    """Reads the messages one stage receives, each in one call: the header's status and call
    checked, its structure decoded and bounds-checked (once per distinct header of each
    message: a header that repeats byte for byte is not decoded again), the tensors viewed
    in the buffer.

    Args:
        stage: the receiving stage (for error messages).
        rank: the receiving rank (a message of another call is its fault to report).
        limit: the largest message a header may announce.
    """

    def __init__(self, stage: int, rank: int, limit: int = MAX_MESSAGE_BYTES) -> None:
        self.stage = stage
        self.rank = rank
        self.limit = limit
        self._decoded: dict[Hashable, tuple[bytes, int, Metas]] = {}

    def read(self, buffer: torch.Tensor, message: Hashable, call: int, sender: int
             ) -> tuple[int, int, Metas, tuple[torch.Tensor, ...]]:
        """``(status, kind, metas, tensors)`` of the uint8 ``buffer`` that rank ``sender``
        sent during ``call``; ``message`` names it for the decoding cache. A notice (status
        ``NEXT``) has no tensors: its message follows (``view`` it).

        Raises:
            PeerError: a failure's header, or a message of another call (``check_status``).
            HeaderError: a corrupt header, or fewer bytes than it announces.
        """
        header = header_of(buffer)
        # The common case read from one numpy view, not by indexing the tensor twice
        # (a read 0.31 -> 0.28-0.31 ms of CPU after a 25 ms sleep, caches cold as between a
        # pipeline's actions); anything else goes to check_status, which raises.
        values = header.numpy()
        status = int(values[STATUS_SLOT])
        if status not in (OK, NEXT) or int(values[CALL_SLOT]) != call:
            check_status(header, call, self.stage, sender, self.rank, (OK, NEXT))
        raw = values[CALL_SLOT + 1:].tobytes()  # as structure_bytes: the same every call
        last = self._decoded.get(message)
        if last is not None and last[0] == raw:
            kind, metas = last[1], last[2]
        else:
            kind, metas = decode_header(header, self.limit)
            self._decoded[message] = (raw, kind, metas)
        return status, kind, metas, (() if status == NEXT else self.view(buffer, metas))

    @staticmethod
    def view(buffer: torch.Tensor, metas: Metas) -> tuple[torch.Tensor, ...]:
        """The tensors of ``metas`` in ``buffer``.

        Raises:
            HeaderError: ``buffer`` is shorter than the message ``metas`` announce.
        """
        size = message_size(metas)
        if buffer.numel() < size:
            raise HeaderError(f"{buffer.numel()} bytes arrived for a header announcing {size}")
        return unpack(buffer, metas)


class BufferPool:
    """Flat byte buffers by size, reused once no tensor shares their storage."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[int, list[torch.Tensor]] = {}
        self._next: dict[int, int] = {}  # where to look first: buffers come back in turn
        self.allocations = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A free buffer of ``nbytes``, as a view: the pool counts views to know it is taken."""
        pool = self._buffers.setdefault(nbytes, [])
        start = self._next.get(nbytes, 0)
        for step in range(len(pool)):
            index = (start + step) % len(pool)
            if _unshared(pool[index]):
                self._next[nbytes] = index + 1
                return pool[index].detach()
        # Never an inference tensor, though the first call may run under inference_mode:
        # a later step writes into the buffer, which torch refuses for one.
        with torch.inference_mode(False):
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.allocations += 1
        pool.append(buffer)
        self._next[nbytes] = 0
        return buffer.detach()


def _unshared(buffer: torch.Tensor) -> bool:
    # The pool's own tensor and the temporary storage object make two uses; any
    # view handed out (and still alive) makes more.
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    return bool(use_count(buffer.untyped_storage()._cdata) <= 2)
