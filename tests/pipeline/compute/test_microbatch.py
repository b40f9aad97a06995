"""Splitting a batch into micro-batches and merging the outputs back."""

from __future__ import annotations

import pytest
import torch

from pipeline.compute.microbatch import batch_size, merge, split


def test_split_follows_tensor_split_with_the_remainder_first() -> None:
    x = torch.arange(13 * 2).reshape(13, 2)
    parts = split(x, 4)
    assert [p.shape[0] for p in parts] == [4, 3, 3, 3]
    assert torch.equal(torch.cat(parts), x)
    assert all(p.data_ptr() >= x.data_ptr() for p in parts)  # views, not copies


@pytest.mark.parametrize(("rows", "chunks"), [(1, 1), (5, 5), (13, 1), (13, 3), (16, 8)])
def test_split_then_merge_is_the_identity(rows: int, chunks: int) -> None:
    x = torch.randn(rows, 3, 2)
    parts = split(x, chunks)
    assert len(parts) == chunks
    assert max(p.shape[0] for p in parts) - min(p.shape[0] for p in parts) <= 1
    assert torch.equal(merge(parts), x)


def test_split_a_tuple_splits_each_tensor_alike() -> None:
    a, b = torch.randn(7, 2), torch.arange(7)
    parts = split((a, b), 3)
    assert [tuple(t.shape[0] for t in p) for p in parts] == [(3, 3), (2, 2), (2, 2)]
    assert all(isinstance(p, tuple) for p in parts)
    merged = merge(parts)
    assert isinstance(merged, tuple)
    assert torch.equal(merged[0], a) and torch.equal(merged[1], b)


def test_presplit_list_is_kept_as_given() -> None:
    parts = [torch.randn(2, 5), torch.randn(3, 7)]  # different lengths are fine
    assert split(parts, 2) == parts
    assert split(parts, 2) is not parts


def test_batch_smaller_than_chunks() -> None:
    with pytest.raises(ValueError, match=r"a batch of 3 rows cannot be split into 4 micro-batches; "
                                         r"expected a batch of at least 4 rows"):
        split(torch.randn(3, 2), 4)
    with pytest.raises(ValueError, match=r"batch of 2 rows"):
        split((torch.randn(2, 2), torch.randn(2)), 3)


def test_tuple_tensors_must_share_dim_0() -> None:
    with pytest.raises(ValueError, match=r"must share dim 0, got sizes \[4, 5\]"):
        split((torch.randn(4, 2), torch.randn(5, 2)), 2)


def test_presplit_list_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match=r"expected 3, got 2"):
        split([torch.randn(2), torch.randn(2)], 3)


@pytest.mark.parametrize("value", [[1.0, 2.0], 3, "batch", torch.tensor(1.0)])
def test_not_a_batch(value: object) -> None:
    with pytest.raises((TypeError, ValueError), match=r"tensor|entry per micro-batch"):
        split(value, 1)  # type: ignore[arg-type]


def test_batch_size_of_a_scalar_or_a_non_tensor() -> None:
    with pytest.raises(TypeError, match=r"with a batch dimension, got Tensor"):
        batch_size(torch.tensor(2.0))
    with pytest.raises(TypeError, match=r"got int"):
        batch_size((3, None))  # type: ignore[arg-type]
    assert batch_size((torch.randn(5, 1), torch.randn(5))) == 5
    assert batch_size((3, {"tokens": torch.zeros(4, 2)})) == 4


def test_nested_batches_split_leaf_by_leaf_and_merge_back() -> None:
    batch = {"tokens": torch.arange(10).view(5, 2), "extra": (torch.randn(5), 7, None)}
    parts = split(batch, 2)
    assert [p["tokens"].shape[0] for p in parts] == [3, 2]
    assert parts[1]["extra"][1] == 7 and parts[1]["extra"][2] is None
    merged = merge(parts)
    assert torch.equal(merged["tokens"], batch["tokens"])
    assert torch.equal(merged["extra"][0], batch["extra"][0]) and merged["extra"][1] == 7


def test_nested_batches_must_agree_on_rows() -> None:
    with pytest.raises(ValueError, match=r"share dim 0, got sizes \[3, 5\]"):
        split({"a": torch.zeros(3), "b": torch.zeros(5)}, 2)
