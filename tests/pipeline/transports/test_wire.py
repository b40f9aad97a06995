"""The wire format (pipeline.transports.wire): headers, and tensors packed into one message."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import wire_workers
from dist_harness import in_turn, run_ranks
from pipeline.errors import PeerError
from pipeline.payloads.tree import from_wire, to_wire
from pipeline.transports.wire import (
    HEADER_BYTES,
    HEADER_SLOTS,
    MAX_DIMS,
    MAX_MESSAGE_BYTES,
    MAX_TENSORS,
    NEXT,
    OK,
    TENSOR,
    STRUCTURED,
    TUPLE,
    HeaderError,
    BufferPool,
    MessageReader,
    call_stamp,
    check_announces,
    check_status,
    decode_failure,
    decode_header,
    encode_failure,
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

CASES = [
    (torch.randn(3, 5, dtype=torch.float64),),
    (torch.randn(2, 3), torch.arange(7), torch.tensor(True)),  # a 0-dim bool among others
    (torch.randn(4, 1, 3).to(torch.bfloat16), torch.empty(0, 5), torch.randn(3, dtype=torch.complex128)),
    (torch.randint(0, 255, (9,), dtype=torch.uint8), torch.randn(2, 2).to(torch.float16)),
]


@pytest.mark.parametrize("tensors", CASES)
def test_pack_then_unpack_gives_the_same_tensors(tensors: tuple[torch.Tensor, ...]) -> None:
    metas = tuple((t.dtype, tuple(t.shape)) for t in tensors)
    buffer = torch.full((message_size(metas),), 0xAB, dtype=torch.uint8)
    pack(encode_header(metas, TUPLE), tensors, buffer)
    kind, decoded = decode_header(buffer[:HEADER_BYTES].view(torch.int64))
    assert kind == TUPLE and decoded == metas
    for original, received in zip(tensors, unpack(buffer, decoded), strict=True):
        assert received.dtype == original.dtype and received.shape == original.shape
        assert torch.equal(received, original)
        assert received.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_message_size_aligns_every_tensor() -> None:
    metas = ((torch.uint8, (3,)), (torch.complex128, (2,)))
    assert message_size(metas) == HEADER_BYTES + 16 + 32
    assert message_size(()) == HEADER_BYTES


def test_too_many_tensors_or_dims_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=f"at most {MAX_TENSORS} tensors, got {MAX_TENSORS + 1}"):
        encode_header(((torch.float32, (1,)),) * (MAX_TENSORS + 1), TUPLE)
    # A list of 16 tensors is a structure: its shape takes the 17th slot, and the message
    # counts the user's 16.
    with pytest.raises(ValueError, match=f"at most {MAX_TENSORS - 1} tensors in a structure .*"
                                         f"got {MAX_TENSORS}"):
        encode_header(((torch.float32, (1,)),) * (MAX_TENSORS + 1), STRUCTURED)
    with pytest.raises(ValueError, match=r"at most 8 dims .* shape \(1, 1, 1, 1, 1, 1, 1, 1, 1\)"):
        encode_header(((torch.float32, (1,) * 9),), TENSOR)


def test_a_failure_header_carries_its_origin_and_reason() -> None:
    origin, reason = decode_failure(encode_failure(3, "ValueError: bad layer é"))
    assert (origin, reason) == (3, "ValueError: bad layer é")
    origin, reason = decode_failure(encode_failure(1, "x" * 10_000))
    assert origin == 1 and reason == "x" * (HEADER_BYTES - 32)


def test_the_pool_reuses_a_buffer_once_no_view_of_it_is_alive() -> None:
    pool = BufferPool(torch.device("cpu"))
    first = pool.take(64)
    second = pool.take(64)
    assert pool.allocations == 2
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    address = first.untyped_storage().data_ptr()
    view = first[8:16].view(torch.int64)
    del first
    third = pool.take(64)  # `view` still holds the first buffer
    assert pool.allocations == 3 and third.untyped_storage().data_ptr() != address
    del view, third
    again = pool.take(64)  # a freed buffer, never the one `second` still holds
    assert pool.allocations == 3
    assert again.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()


def _header(values: list[int]) -> torch.Tensor:
    return torch.tensor(values + [0] * (HEADER_SLOTS - len(values)), dtype=torch.int64)


@pytest.mark.parametrize(("values", "complaint"), [
    ([0, 0, 7, 1], r"payload kind must be 0, 1 or 2, got 7"),
    ([0, 0, 1, 0], r"tensor count must be in 1..16, got 0"),
    ([0, 0, 1, 10**6], r"tensor count must be in 1..16, got 1000000"),
    ([0, 0, 0, 1, 99, 1, 4], r"dtype index must be in 0..11, got 99"),
    ([0, 0, 0, 1, 0, -1], r"0..8 dimensions, got -1"),
    ([0, 0, 0, 1, 0, 9], r"0..8 dimensions, got 9"),
    ([0, 0, 0, 1, 0, 2, 5, -3], r"sizes must be in 0..\d+, got shape \(5, -3\)"),
    ([0, 0, 0, 1, 0, 3, 1 << 20, 1 << 20, 1 << 10], r"announces \d+ bytes, more than the limit"),
])
def test_corrupt_headers_are_refused_before_any_allocation(values: list[int], complaint: str) -> None:
    with pytest.raises(HeaderError, match=complaint):
        decode_header(_header(values))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=HEADER_SLOTS, max_size=HEADER_SLOTS))
def test_random_headers_decode_within_the_limit_or_are_refused(values: list[int]) -> None:
    values[2] = values[2] % 4  # mostly plausible kinds, so the deeper checks are reached
    values[3] = values[3] % (MAX_TENSORS + 2)
    try:
        _, metas = decode_header(torch.tensor(values, dtype=torch.int64))
    except HeaderError:
        return
    assert message_size(metas) <= MAX_MESSAGE_BYTES
    assert all(len(shape) <= MAX_DIMS and min(shape, default=0) >= 0 for _, shape in metas)


@pytest.mark.parametrize("payload", [
    {"hidden": [torch.randn(2, 3), None], "rows": 2, "mask": torch.ones(2, dtype=torch.bool)},
    [torch.randn(2), (torch.arange(3), "text")],
    (torch.randn(1), 5),
    {"only": None},
])
def test_structured_payloads_round_trip(payload: object) -> None:
    kind, tensors = to_wire(payload)
    back = from_wire(kind, tuple(tensors))
    flat_in, spec_in = torch.utils._pytree.tree_flatten(payload)
    flat_out, spec_out = torch.utils._pytree.tree_flatten(back)
    assert spec_in == spec_out
    for a, b in zip(flat_in, flat_out):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


METAS = ((torch.float32, (2, 3)), (torch.int64, (5,)))


def test_a_stamped_message_passes_its_own_calls_check_only() -> None:
    stamp = call_stamp(7, training=True)
    for header in (encode_header(METAS, TUPLE, stamp),  # stamped when encoded
                   _stamped(encode_header(METAS, TUPLE), stamp)):  # or in the message
        assert check_status(header, stamp, stage=1, sender=0, receiver=1) == OK
        refusal = (r"during its call 6 \(an inference call\).* rank 0 "
                   r"sent during its call 7 \(a training step\)")
        with pytest.raises(PeerError, match=refusal) as caught:
            check_status(header, call_stamp(6, training=False), stage=1, sender=0, receiver=1)
        assert caught.value.rank == 1  # the receiver's, as the transports always said


def _stamped(header: torch.Tensor, stamp: int) -> torch.Tensor:
    message = torch.zeros(message_size(METAS), dtype=torch.uint8)
    pack(header, (), message)
    stamp_call(message, stamp)
    return header_of(message)


def test_a_notice_says_next_with_the_messages_own_structure_and_call() -> None:
    header = encode_header(METAS, TUPLE)
    notice = torch.full((message_size(METAS),), 0xAB, dtype=torch.uint8)
    write_notice(notice, header, stamp=5)
    read = header_of(notice)
    assert check_status(read, 5, stage=2, sender=1, receiver=2, statuses=(OK, NEXT)) == NEXT
    assert decode_header(read) == (TUPLE, METAS)
    assert structure_bytes(read) == structure_bytes(header)  # status and call left out
    assert structure_bytes(read) != structure_bytes(encode_header(METAS[:1], TUPLE))
    # Where no notice is expected (NCCL's rules), one is a corrupt header.
    with pytest.raises(HeaderError, match="status 2"):
        check_status(read, 5, stage=2, sender=1, receiver=2)


def test_a_failure_message_fills_the_size_expected_and_names_its_origin() -> None:
    message = failure_message(3, "ValueError: bad layer", message_size(METAS), torch.device("cpu"))
    assert message.numel() == message_size(METAS) and message.dtype == torch.uint8
    assert not message[HEADER_BYTES:].any()
    assert torch.equal(header_of(message), encode_failure(3, "ValueError: bad layer"))
    with pytest.raises(PeerError, match=r"rank 3 failed: ValueError: bad layer; stage 1 stops") \
            as caught:
        check_status(header_of(message), 0, stage=1, sender=0, receiver=1, statuses=(OK, NEXT))
    assert caught.value.rank == 3


def test_a_reader_reads_a_message_or_a_notice_in_one_call_and_refuses_a_short_one() -> None:
    """MessageReader: the receiving end's one call into the wire format per message."""
    tensors = (torch.randn(2, 3), torch.arange(5))
    stamp = call_stamp(4, training=True)
    message = torch.zeros(message_size(METAS), dtype=torch.uint8)
    pack(encode_header(METAS, TUPLE, stamp), tensors, message)
    reader = MessageReader(stage=1, rank=1)
    for _ in range(2):  # the second read finds the header decoded already
        status, kind, metas, read = reader.read(message, "F0", stamp, sender=0)
        assert (status, kind, metas) == (OK, TUPLE, METAS)
        assert all(torch.equal(a, b) for a, b in zip(read, tensors))
        assert read[0].untyped_storage().data_ptr() == message.untyped_storage().data_ptr()
    notice = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    write_notice(notice, encode_header(METAS, TUPLE), stamp)
    assert reader.read(notice, "F1", stamp, sender=0) == (NEXT, TUPLE, METAS, ())
    with pytest.raises(HeaderError, match=f"{HEADER_BYTES} bytes arrived for a header "
                                          f"announcing {message_size(METAS)}"):
        reader.view(notice, METAS)
    with pytest.raises(PeerError, match="sent during its call 4"):
        reader.read(message, "F0", call_stamp(5, training=True), sender=0)


def test_a_status_no_sender_writes_is_a_header_error() -> None:
    with pytest.raises(HeaderError, match="status 9"):
        check_status(_header([9, 0, 0, 1]), 0, stage=0, sender=1, receiver=0, statuses=(OK, NEXT))


TRANSPORTS = ("gloo", "ordered")


@pytest.fixture(scope="module")
def understated() -> dict[str, list[tuple[str, float]]]:
    """One spawn of 2 ranks (each spawn costs seconds), each transport in turn: per
    transport, each rank's (outcome, seconds)."""
    calls = [(wire_workers.understated_header, (transport,)) for transport in TRANSPORTS]
    per_rank = run_ranks(in_turn, 2, calls, timeout=120)
    return {transport: [results[index] for results in per_rank]
            for index, transport in enumerate(TRANSPORTS)}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_message_larger_than_its_header_announces_is_a_peer_error_not_an_abort(
        transport: str, understated: dict[str, list[tuple[str, float]]]) -> None:
    """Rank 0's headers understate its messages: it refuses to send them (gloo would abort
    rank 1, which posts the announced size, on receiving more), and rank 1 gets a
    PeerError naming rank 0, within the timeout."""
    (sender, _), (receiver, seconds) = understated[transport]
    assert sender.startswith("HeaderError") and "header announces" in sender, sender
    assert receiver.startswith("PeerError") and "rank 0 failed" in receiver, receiver
    assert seconds < 10, (receiver, seconds)


def test_a_header_that_announces_another_size_is_refused_before_sending() -> None:
    metas = ((torch.float64, (8, 6)),)
    check_announces(encode_header(metas, TENSOR), metas)
    for announced in (((torch.float64, (7, 6)),), ((torch.float64, (9, 6)),),
                      ((torch.float32, (8, 6)),)):
        with pytest.raises(HeaderError, match="header announces"):
            check_announces(encode_header(announced, TENSOR), metas)
