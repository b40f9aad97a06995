"""How micro-batch losses add up to exactly the whole batch's loss.

A loss with ``reduction="mean"`` divides by a count that belongs to the whole
batch: the rows, the elements, or (for cross-entropy with ``ignore_index`` or
class weights) the sum of the weights of the targets that count. The mean of
micro-batch means is not that: a micro-batch with many padding tokens would
weigh as much as a full one, and a micro-batch whose targets are all ignored
would give NaN. So the runtime computes every micro-batch's loss as a *sum*
and divides each by the whole batch's count, known from the targets before the
first forward:

- torch's loss modules (``nn.CrossEntropyLoss``, ``nn.NLLLoss``, ``nn.MSELoss``,
  ``nn.L1Loss``, ``nn.BCEWithLogitsLoss``, ``nn.KLDivLoss``, ...): handled
  automatically: the module is called with ``reduction="sum"`` and the count
  is derived from the targets as torch's own mean would (weighted, ignoring
  ``ignore_index``; rows for ``"batchmean"``). ``reduction="sum"`` adds up.
- any other callable with ``loss_count=``: ``loss_fn`` returns a micro-batch's
  sum and ``loss_count(target)`` its count (say the non-padding tokens); the
  step returns and differentiates ``sum of sums / sum of counts``.
- any other callable alone: it returns a mean over its rows, and micro-batches
  are weighted by their share of the batch's rows.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.microbatch import batch_size

LossFn = Callable[..., Any]
CountFn = Callable[[Any], Any]

_INDEXED = (nn.CrossEntropyLoss, nn.NLLLoss)
# Losses whose mean divides the sum by the target's element count (or rows, for a 1-D target).
_ELEMENTWISE = (
    nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss, nn.BCEWithLogitsLoss,
    nn.PoissonNLLLoss, nn.SoftMarginLoss, nn.HingeEmbeddingLoss, nn.KLDivLoss, nn.MultiMarginLoss,
)


@dataclass(frozen=True)
class LossRule:
    """The per-micro-batch loss to run, and how to weight each micro-batch's result."""

    function: LossFn
    count: Callable[[Sequence[Any]], list[float]]

    def weights(self, targets: Sequence[Any]) -> list[float]:
        """One factor per micro-batch: its loss x factor, added up, is the batch loss."""
        return self.count(targets)


def loss_rule(loss_fn: LossFn | None, loss_count: CountFn | None = None) -> LossRule | None:
    """The rule that makes ``loss_fn`` exact over micro-batches (see the module docstring).

    Raises:
        TypeError: ``loss_fn`` or ``loss_count`` is not callable.
        ValueError: a torch loss module with ``reduction="none"``.
    """
    if loss_fn is None:
        return None
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if loss_count is not None:
        if not callable(loss_count):
            raise TypeError(f"loss_count must be callable, got {type(loss_count).__name__}")
        return LossRule(loss_fn, lambda targets: _inverse_total(
            [_as_float(loss_count(t), "loss_count") for t in targets]))
    if isinstance(loss_fn, nn.modules.loss._Loss):
        return _module_rule(loss_fn)
    return LossRule(loss_fn, _row_shares)


def _module_rule(module: nn.modules.loss._Loss) -> LossRule:
    reduction = module.reduction
    if reduction == "none":
        raise ValueError(
            f"{type(module).__name__}(reduction='none') gives a loss per element; "
            f"Pipe needs a scalar: use reduction='mean' or 'sum'"
        )
    if reduction == "sum":
        return LossRule(module, lambda targets: [1.0] * len(targets))
    summed = copy.copy(module)
    summed.reduction = "sum"
    if reduction == "batchmean":
        return LossRule(summed, lambda targets: _inverse_total([batch_size(t) for t in targets]))
    if isinstance(module, _INDEXED):
        return LossRule(summed, lambda targets: _inverse_total(
            [_indexed_count(module, t) for t in targets]))
    if isinstance(module, _ELEMENTWISE):
        return LossRule(summed, lambda targets: _inverse_total([_elements(t) for t in targets]))
    raise ValueError(
        f"{type(module).__name__}(reduction='mean') divides by a count Pipe cannot derive from "
        f"the targets alone, so micro-batch means would not add up to the batch's; pass "
        f"{type(module).__name__}(reduction='sum') with loss_count=lambda target: <what the "
        f"mean divides by for that micro-batch>"
    )


def _indexed_count(module: nn.Module, target: torch.Tensor) -> float:
    """What torch's mean divides by for one micro-batch of class-index (or probability) targets."""
    if target.is_floating_point():
        # Class probabilities: one term per position, the class dimension (1) summed away.
        return float(target.numel() // max(1, target.shape[1] if target.dim() > 1 else 1))
    kept = target != module.ignore_index  # type: ignore[attr-defined]
    weight = module.weight  # type: ignore[attr-defined]
    if weight is None:
        return float(kept.sum())
    return float(weight.to(target.device)[target[kept]].double().sum())


def _elements(target: Any) -> float:
    if isinstance(target, torch.Tensor):
        return float(target.numel())
    raise TypeError(
        f"a loss module with reduction='mean' needs tensor targets to count their elements, "
        f"got {type(target).__name__}; pass loss_count=... to say what a micro-batch counts"
    )


def _row_shares(targets: Sequence[Any]) -> list[float]:
    return _inverse_total([batch_size(t) for t in targets], shares=True)


def _inverse_total(counts: Sequence[float], shares: bool = False) -> list[float]:
    total = float(sum(counts))
    if shares:
        return [c / total for c in counts]
    # A batch that counts nothing (all targets ignored) has a NaN mean, as in torch.
    factor = 1.0 / total if total else float("nan")
    return [factor] * len(counts)


def _as_float(value: Any, name: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{name} must return a number or a one-element tensor, got {value!r}")


def check_loss_value(value: Any, microbatch: int, stage: int) -> torch.Tensor:
    """Return ``value`` if it is a scalar tensor, else raise a TypeError/ValueError naming it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"loss_fn must return a scalar tensor, got {type(value).__name__} ({value!r}) "
            f"for micro-batch {microbatch} on stage {stage}"
        )
    if value.dim() != 0:
        raise ValueError(
            f"loss_fn must return a scalar, got a tensor of shape {tuple(value.shape)} "
            f"for micro-batch {microbatch} on stage {stage}"
        )
    return value
