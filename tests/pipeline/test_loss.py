"""Micro-batch losses add up to exactly the whole batch's loss (pipeline.loss), in one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipeline import Pipe

TOLERANCE = 1e-10
SCHEDULES = ("gpipe", "1f1b", "zb-h1")


def _classifier() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5)).double()


def _compare(loss_fn: nn.Module | object, x: torch.Tensor, y: torch.Tensor, schedule: str,
             chunks: int = 4, **pipe_options: object) -> None:
    model = _classifier()
    reference = copy.deepcopy(model)
    expected = loss_fn(reference(x), y)  # type: ignore[operator]
    expected.backward()
    pipe = Pipe(model, chunks=chunks, balance=[2, 1], devices=["cpu", "cpu"], schedule=schedule,
                loss_fn=loss_fn, **pipe_options)  # type: ignore[arg-type]
    loss = pipe.step(x, y)
    assert torch.allclose(loss, expected.detach(), atol=TOLERANCE, rtol=0, equal_nan=True)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        assert torch.allclose(p.grad, q.grad, atol=TOLERANCE, rtol=0, equal_nan=True), name


def _padded_targets() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(12, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 5, (12,), generator=generator)
    y[3:6] = -100  # micro-batch 1 of 4 is all padding
    y[[0, 7, 11]] = -100
    return x, y


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_ignore_index_counts_tokens_not_rows(schedule: str) -> None:
    x, y = _padded_targets()
    _compare(nn.CrossEntropyLoss(ignore_index=-100), x, y, schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_class_weights_and_label_smoothing(schedule: str) -> None:
    x, y = _padded_targets()
    weight = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.25], dtype=torch.float64)
    _compare(nn.CrossEntropyLoss(weight=weight, ignore_index=-100, label_smoothing=0.1), x, y,
             schedule)


def test_nll_module_inside_a_model_head() -> None:
    x, y = _padded_targets()
    weight = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.25], dtype=torch.float64)
    model = _classifier().append(nn.LogSoftmax(-1))
    reference = copy.deepcopy(model)
    expected = nn.NLLLoss(weight=weight)(reference(x), y.clamp(min=0))
    expected.backward()
    pipe = Pipe(model, chunks=4, balance=[2, 2], devices=["cpu", "cpu"],
                loss_fn=nn.NLLLoss(weight=weight))
    assert abs(pipe.step(x, y.clamp(min=0)).item() - expected.item()) < TOLERANCE
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=TOLERANCE, rtol=0)


def test_a_batch_that_is_all_padding_is_nan_like_torch() -> None:
    x, y = _padded_targets()
    _compare(nn.CrossEntropyLoss(), x, torch.full_like(y, -100), "1f1b")


@pytest.mark.parametrize("loss_fn", [nn.MSELoss(), nn.L1Loss(), nn.SmoothL1Loss(beta=0.5),
                                     nn.MSELoss(reduction="sum")])
def test_elementwise_losses_with_an_uneven_last_microbatch(loss_fn: nn.Module) -> None:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(11, 6, generator=generator, dtype=torch.float64)
    y = torch.randn(11, 5, generator=generator, dtype=torch.float64)
    _compare(loss_fn, x, y, "1f1b", chunks=3)


def test_kl_div_batchmean_and_probability_targets() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(10, 6, generator=generator, dtype=torch.float64)
    target = torch.softmax(torch.randn(10, 5, generator=generator, dtype=torch.float64), -1)
    _compare(nn.CrossEntropyLoss(label_smoothing=0.2), x, target, "gpipe", chunks=3)
    model = _classifier().append(nn.LogSoftmax(-1))
    reference = copy.deepcopy(model)
    expected = nn.KLDivLoss(reduction="batchmean")(reference(x), target)
    pipe = Pipe(model, chunks=3, balance=[2, 2], devices=["cpu", "cpu"],
                loss_fn=nn.KLDivLoss(reduction="batchmean"))
    assert abs(pipe.step(x, target).item() - expected.item()) < TOLERANCE


def test_a_sum_with_loss_count_is_exact_for_a_token_weighted_callable() -> None:
    x, y = _padded_targets()

    def summed(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, target, ignore_index=-100, reduction="sum")

    model = _classifier()
    reference = copy.deepcopy(model)
    expected = F.cross_entropy(reference(x), y, ignore_index=-100)
    expected.backward()
    pipe = Pipe(model, chunks=4, balance=[2, 1], devices=["cpu", "cpu"], loss_fn=summed,
                loss_count=lambda t: (t != -100).sum())
    assert abs(pipe.step(x, y).item() - expected.item()) < TOLERANCE
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("result", [1.5, None, (torch.tensor(1.0),)])
def test_a_loss_fn_that_returns_no_tensor_is_a_type_error(result: object) -> None:
    pipe = Pipe(_classifier(), chunks=2, balance=[2, 1], devices=["cpu", "cpu"],
                loss_fn=lambda out, t: result)
    with pytest.raises(TypeError, match=r"loss_fn must return a scalar tensor, got"):
        pipe.step(torch.randn(4, 6, dtype=torch.float64), torch.zeros(4))


def test_reduction_none_and_bad_loss_count_are_refused() -> None:
    with pytest.raises(ValueError, match=r"reduction='none'.*needs a scalar"):
        Pipe(_classifier(), chunks=2, balance=[2, 1], devices=["cpu", "cpu"],
             loss_fn=nn.MSELoss(reduction="none"))
    with pytest.raises(TypeError, match=r"loss_count must be callable, got int"):
        Pipe(_classifier(), chunks=2, balance=[2, 1], devices=["cpu", "cpu"],
             loss_fn=nn.MSELoss(), loss_count=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("loss_fn", [nn.CTCLoss(), nn.MultiLabelSoftMarginLoss(),
                                     nn.MultiLabelMarginLoss()])
def test_a_mean_that_the_targets_cannot_count_is_refused_with_the_fix(loss_fn: nn.Module) -> None:
    with pytest.raises(ValueError, match=r"reduction='sum'\) with loss_count="):
        Pipe(_classifier(), chunks=2, balance=[2, 1], devices=["cpu", "cpu"], loss_fn=loss_fn)
