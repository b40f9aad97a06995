"""microbatch: the largest micro-batch's rows, and the sample and target cut to it."""

from __future__ import annotations

import pytest
import torch

from partitioners.measure.microbatch import first_microbatch, microbatch_rows


@pytest.mark.parametrize("batch", [1, 7, 64, 100])
@pytest.mark.parametrize("microbatches", [1, 3, 7])
def test_rows_match_tensor_split(batch: int, microbatches: int) -> None:
    if microbatches > batch:
        with pytest.raises(ValueError, match="cannot be split"):
            microbatch_rows(batch, None, microbatches)
        return
    largest = max(len(part) for part in torch.tensor_split(torch.arange(batch), microbatches))
    assert microbatch_rows(batch, None, microbatches) == largest


def test_tuples_and_targets_are_cut_alike() -> None:
    sample = (torch.randn(10, 3), torch.arange(10))
    target = torch.arange(10) * 2
    part, labels, rows = first_microbatch(sample, target, 4, None)
    assert rows == 4 and isinstance(part, tuple)
    assert torch.equal(part[1], torch.arange(4)) and torch.equal(labels, torch.arange(4) * 2)
    same, same_target, rows = first_microbatch(sample, target, None, None)
    assert same is sample and same_target is target and rows == 10


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"must share dim 0, got sizes \[3, 4\]"):
        first_microbatch((torch.zeros(3), torch.zeros(4)), None, 2, None)
    with pytest.raises(ValueError, match="need a sample with a batch dimension"):
        first_microbatch(torch.tensor(1.0), None, 1, None)
    assert first_microbatch(torch.tensor(1.0), None, None, None)[2] is None
    with pytest.raises(ValueError, match="microbatch_size must be an int >= 1, got True"):
        microbatch_rows(4, True, None)  # type: ignore[arg-type]
