"""MessageReader.read: what its fast path (status and call from a numpy view) leaves to
check_status: a failure, a status no sender writes, a message of another call."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import PeerError
from pipeline.payloads.tree import TENSOR
from pipeline.transports.wire import (
    CALL_SLOT,
    HEADER_BYTES,
    HeaderError,
    MessageReader,
    OK,
    call_stamp,
    encode_header,
    failure_message,
    message_size,
    pack,
)

METAS = ((torch.float32, (2, 3)),)


def _message(stamp: int, status: int = OK) -> torch.Tensor:
    header = encode_header(METAS, TENSOR, stamp)
    header[0] = status
    message = torch.zeros(message_size(METAS), dtype=torch.uint8)
    pack(header, (torch.ones(2, 3),), message)
    return message


def test_a_failure_read_by_the_reader_names_its_origin_whatever_its_call_slot_holds() -> None:
    stamp = call_stamp(3, training=True)
    failed = failure_message(origin=stamp, reason="out of memory", nbytes=message_size(METAS),
                             device=torch.device("cpu"))  # its call slot holds the origin
    with pytest.raises(PeerError, match=f"rank {stamp} failed: out of memory") as caught:
        MessageReader(stage=1, rank=1).read(failed, "F0", stamp, sender=0)
    assert caught.value.rank == stamp


def test_a_status_no_sender_writes_is_refused_by_the_reader() -> None:
    stamp = call_stamp(2, training=False)
    with pytest.raises(HeaderError, match="status 7"):
        MessageReader(stage=1, rank=1).read(_message(stamp, status=7), "F0", stamp, sender=0)


def test_the_reader_checks_the_call_on_every_message_not_only_the_first() -> None:
    reader = MessageReader(stage=1, rank=1)
    first, second = call_stamp(1, training=True), call_stamp(2, training=True)
    message = _message(first)
    status, _, metas, (tensor,) = reader.read(message, "F0", first, sender=0)
    assert (status, metas) == (OK, METAS) and torch.equal(tensor, torch.ones(2, 3))
    with pytest.raises(PeerError, match="call 1"):
        reader.read(message, "F0", second, sender=0)  # same bytes, decoded already: refused
    message[8 * CALL_SLOT: 8 * CALL_SLOT + 8].view(torch.int64).fill_(second)
    assert reader.read(message, "F0", second, sender=0)[0] == OK
    assert message.numel() > HEADER_BYTES
