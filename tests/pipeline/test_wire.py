"""The wire format of DistTransport (pipeline.wire): headers, and tensors packed into one message."""

from __future__ import annotations

import pytest
import torch

from pipeline.wire import (
    HEADER_BYTES,
    MAX_TENSORS,
    BufferPool,
    decode_failure,
    decode_header,
    encode_failure,
    encode_header,
    message_size,
    pack,
    unpack,
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
    pack(encode_header(metas, is_tuple=True), tensors, buffer)
    is_tuple, decoded = decode_header(buffer[:HEADER_BYTES].view(torch.int64))
    assert is_tuple and decoded == metas
    for original, received in zip(tensors, unpack(buffer, decoded), strict=True):
        assert received.dtype == original.dtype and received.shape == original.shape
        assert torch.equal(received, original)
        assert received.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_message_size_aligns_every_tensor() -> None:
    metas = ((torch.uint8, (3,)), (torch.complex128, (2,)))
    assert message_size(metas) == HEADER_BYTES + 16 + 32
    assert message_size(()) == HEADER_BYTES


def test_too_many_tensors_or_dims_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=f"at most {MAX_TENSORS} tensors, got 9"):
        encode_header(((torch.float32, (1,)),) * 9, is_tuple=True)
    with pytest.raises(ValueError, match=r"at most 8 dims .* shape \(1, 1, 1, 1, 1, 1, 1, 1, 1\)"):
        encode_header(((torch.float32, (1,) * 9),), is_tuple=False)


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
