"""Micro-batch losses add up to exactly the whole batch's loss (pipeline.compute.loss): one process, two ranks."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dist_harness import run_ranks
from pipeline import Pipe, SummedLoss
from pipeline.compute.loss import loss_rule

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


def test_a_summed_loss_is_exact_for_a_token_weighted_callable() -> None:
    x, y = _padded_targets()

    def summed(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, target, ignore_index=-100, reduction="sum")

    model = _classifier()
    reference = copy.deepcopy(model)
    expected = F.cross_entropy(reference(x), y, ignore_index=-100)
    expected.backward()
    pipe = Pipe(model, chunks=4, balance=[2, 1], devices=["cpu", "cpu"],
                loss_fn=SummedLoss(summed, count=lambda t: (t != -100).sum()))
    assert abs(pipe.step(x, y).item() - expected.item()) < TOLERANCE
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("result", [1.5, None, (torch.tensor(1.0),)])
def test_a_loss_fn_that_returns_no_tensor_is_a_type_error(result: object) -> None:
    pipe = Pipe(_classifier(), chunks=2, balance=[2, 1], devices=["cpu", "cpu"],
                loss_fn=lambda out, t: result)
    with pytest.raises(TypeError, match=r"loss_fn must return a scalar tensor, got"):
        pipe.step(torch.randn(4, 6, dtype=torch.float64), torch.zeros(4))


def test_reduction_none_and_a_bad_summed_loss_are_refused() -> None:
    with pytest.raises(ValueError, match=r"reduction='none'.*needs a scalar"):
        Pipe(_classifier(), chunks=2, balance=[2, 1], devices=["cpu", "cpu"],
             loss_fn=nn.MSELoss(reduction="none"))
    with pytest.raises(TypeError, match=r"SummedLoss.count must be callable, got int"):
        SummedLoss(nn.MSELoss(reduction="sum"), count=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("loss_fn", [nn.CTCLoss(), nn.MultiLabelSoftMarginLoss(),
                                     nn.MultiLabelMarginLoss()])
def test_a_mean_that_the_targets_cannot_count_is_refused_with_the_fix(loss_fn: nn.Module) -> None:
    with pytest.raises(ValueError, match=r"loss_fn=SummedLoss\(\w+\(reduction='sum'\), count="):
        Pipe(_classifier(), chunks=2, balance=[2, 1], devices=["cpu", "cpu"], loss_fn=loss_fn)


# -- what the targets alone do not show: broadcasting, and a subclass's own forward ------------


def _broadcast_batch(rows: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(rows, 6, generator=generator, dtype=torch.float64)
    return x, torch.randn(rows, 1, generator=generator, dtype=torch.float64)


@pytest.mark.filterwarnings("ignore:Using a target size")
@pytest.mark.parametrize("schedule", ("1f1b", "zb-h1"))
@pytest.mark.parametrize("loss_fn", [nn.MSELoss(), nn.L1Loss(), nn.SmoothL1Loss(beta=0.5),
                                     nn.MSELoss(reduction="sum")])
def test_a_broadcast_target_counts_what_torch_divides_by(loss_fn: nn.Module, schedule: str) -> None:
    # (11, 5) outputs against (11, 1) targets: torch's mean divides by 55, not 11.
    x, y = _broadcast_batch()
    _compare(loss_fn, x, y, schedule)


@pytest.mark.filterwarnings("ignore:Using a target size")
def test_a_broadcast_that_pairs_rows_of_different_microbatches_is_refused() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    x, y = _broadcast_batch(12)
    pipe = Pipe(model, chunks=4, balance=[2, 1], devices=["cpu", "cpu"], loss_fn=nn.MSELoss())
    message = (r"MSELoss broadcasts an output of shape \(3, 1\) against a target of shape \(3,\) "
               r"to \(3, 3\).*target.unsqueeze\(-1\).*loss_fn=SummedLoss\(fn, count\)")
    with pytest.raises(ValueError, match=message):
        pipe.step(x, y.squeeze(-1))


class _MeanTokenLoss(nn.CrossEntropyLoss):
    """Ignores self.reduction: always a mean over the micro-batch's tokens."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)


class _TokenLoss(nn.CrossEntropyLoss):
    """README's: (batch, seq, classes) logits, (batch, seq) targets, through super().forward."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return super().forward(logits.flatten(0, 1), target.flatten())


def _token_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(8, 7, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 5, (8, 7), generator=generator)
    y[::2, 4:] = -100  # padding: half the rows end early
    y[2:4] = -100  # micro-batch 1 of 4 is all padding
    return x, y


@pytest.mark.parametrize("schedule", ("1f1b", "zb-h1"))
def test_a_subclass_that_honours_reduction_stays_exact(schedule: str) -> None:
    x, y = _token_batch()
    _compare(_TokenLoss(ignore_index=-100), x, y, schedule)
    weight = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.25], dtype=torch.float64)
    _compare(_TokenLoss(weight=weight, ignore_index=-100, reduction="sum"), x, y, schedule)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_subclass_that_ignores_reduction_is_refused_with_the_fix(reduction: str) -> None:
    x, y = _token_batch()
    model = _classifier()
    pipe = Pipe(model, chunks=4, balance=[2, 1], devices=["cpu", "cpu"],
                loss_fn=_MeanTokenLoss(ignore_index=-100, reduction=reduction))
    message = (r"_MeanTokenLoss ignores self.reduction: on a micro-batch that counts 11 .* "
               r"expected the sum to be 11 x .*pass reduction=self.reduction.*"
               r"super\(\).forward.*loss_fn=SummedLoss\(fn, count=")
    with pytest.raises(ValueError, match=message):
        pipe.step(x, y)
    assert all(p.grad is None for p in model.parameters())


class _DrawingTokenLoss(_TokenLoss):
    """Honours reduction, and draws one random number per call (as a noisy loss might)."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return super().forward(logits, target) + 0.0 * torch.rand((), dtype=logits.dtype)


def test_checking_a_subclass_leaves_the_rng_and_gradients_as_they_were() -> None:
    _, y = _token_batch()
    logits = torch.randn(8, 7, 5, dtype=torch.float64, requires_grad=True)
    rule = loss_rule(_DrawingTokenLoss(ignore_index=-100))
    assert rule is not None
    torch.manual_seed(7)
    loss = rule.function(logits, y)  # the check's two extra calls, then the real one
    checked = torch.get_rng_state()
    loss.backward()
    torch.manual_seed(7)
    torch.rand((), dtype=torch.float64)  # the real call's one draw
    assert torch.equal(checked, torch.get_rng_state())
    plain = logits.detach().requires_grad_()
    expected = F.cross_entropy(plain.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
    expected.backward()
    assert torch.allclose(loss, expected, atol=TOLERANCE, rtol=0)
    assert torch.equal(logits.grad, plain.grad)


def _on_rank(rank: int, world: int) -> tuple[float, float, int, str]:
    """Broadcast MSELoss over two ranks (errors against the plain model), then the refusal."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "Using a target size")
    last = rank == world - 1
    x, y = _broadcast_batch()
    model = _classifier()
    reference = copy.deepcopy(model)
    expected = nn.MSELoss()(reference(x), y)
    expected.backward()
    pipe = Pipe(model, chunks=4, balance=[2, 1], schedule="1f1b", loss_fn=nn.MSELoss(),
                group=dist.group.WORLD, timeout=30)
    loss = pipe.step(x if rank == 0 else None, y if last else None)
    worst, compared = 0.0, 0
    for p, q in zip(model.parameters(), reference.parameters()):
        if not p.is_meta:  # another rank's layer
            difference = float("inf") if p.grad is None else (p.grad - q.grad).abs().max().item()
            worst, compared = max(worst, difference), compared + 1
    pipe.close()
    tokens, targets = _token_batch()
    refusing = Pipe(_classifier(), chunks=4, balance=[2, 1], schedule="1f1b",
                    loss_fn=_MeanTokenLoss(ignore_index=-100), group=dist.group.WORLD, timeout=30)
    try:
        refusing.step(tokens if rank == 0 else None, targets if last else None)
        refused = "no error"
    except Exception as error:
        refused = f"{type(error).__name__}: {error}"
    return abs(loss.item() - expected.item()), worst, compared, refused


@pytest.mark.filterwarnings("ignore:Using a target size")
def test_two_ranks_broadcast_is_exact_and_an_ignored_reduction_is_refused_on_every_rank() -> None:
    results = run_ranks(_on_rank, 2, timeout=120)
    for rank, (loss_error, grad_error, compared, refused) in enumerate(results):
        assert loss_error < TOLERANCE and grad_error < TOLERANCE and compared > 0, rank
        assert refused != "no error", rank
    refusal = "LossFunctionError: _MeanTokenLoss ignores self.reduction"
    assert results[1][3].startswith(refusal)
    assert results[0][3].startswith(f"PeerError: rank 1 failed: {refusal}")
