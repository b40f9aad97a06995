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
- ``SummedLoss(fn, count)``: ``fn`` returns a micro-batch's sum and
  ``count(target)`` its count (say the non-padding tokens); the step returns and
  differentiates ``sum of sums / sum of counts``.
- any other callable alone: it returns a mean over its rows, and micro-batches
  are weighted by their share of the batch's rows.

Two things the targets alone do not show are settled on the last chunk, where
the output meets the target (``ModuleLoss``). An element-wise loss broadcasts
the output against the target and its mean divides by the broadcast size: an
(n, 6) output against an (n, 1) target counts 6n. That ratio is the same for
every micro-batch, so each micro-batch's sum is divided by it; shapes that pair
a row with other rows (an (n, 1) output against an (n,) target: (n, n)) cannot
be split and are refused. And a subclass whose ``forward`` ignores
``self.reduction`` would return a mean where a sum is asked for: its first
micro-batch is also evaluated under the mean, without gradients, and refused
unless the sum is the mean times the count.
"""

from __future__ import annotations

import copy
import functools
import math
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from pipeline.compute.microbatch import batch_size
from pipeline.errors import StageError

LossFn = Callable[..., Any]
CountFn = Callable[[Any], Any]

_INDEXED = (nn.CrossEntropyLoss, nn.NLLLoss)
# Losses whose mean divides the sum by the target's element count (or rows, for a 1-D target).
_ELEMENTWISE = (
    nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss, nn.BCEWithLogitsLoss,
    nn.PoissonNLLLoss, nn.SoftMarginLoss, nn.HingeEmbeddingLoss, nn.KLDivLoss, nn.MultiMarginLoss,
)
# The element-wise ones that broadcast the output against the target (the BCE losses and
# MultiMarginLoss require matching shapes): their mean divides by the broadcast size.
_BROADCASTING = (
    nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.PoissonNLLLoss, nn.SoftMarginLoss,
    nn.HingeEmbeddingLoss, nn.KLDivLoss,
)
# A subclass with its own forward is checked on at most this many micro-batches, until one
# can tell whether it honours reduction (one that counts 0 or 1, or whose loss is 0, cannot).
_CHECK_ATTEMPTS = 8


class LossFunctionError(ValueError):
    """A loss_fn whose micro-batch results cannot add up to the batch's: says why and the fix."""


@dataclass(frozen=True)
class SummedLoss:
    """A loss that returns a micro-batch's *sum*, and what each micro-batch counts.

    ``Pipe(..., loss_fn=SummedLoss(token_loss_sum, count=lambda t: (t != -100).sum()))``:
    the step's loss is the sum of the micro-batches' sums over the sum of their counts.

    Attributes:
        fn: ``fn(output, target)``, the micro-batch's summed loss.
        count: ``count(target)``, what that micro-batch counts toward the denominator.
    """

    fn: LossFn
    count: CountFn

    def __post_init__(self) -> None:
        for name in ("fn", "count"):
            if not callable(getattr(self, name)):
                raise TypeError(f"SummedLoss.{name} must be callable, got "
                                f"{type(getattr(self, name)).__name__}")

    def __call__(self, output: Any, target: Any) -> Any:
        return self.fn(output, target)


@dataclass(frozen=True)
class LossRule:
    """The per-micro-batch loss to run, and how to weight each micro-batch's result.

    Attributes:
        function: the loss of one micro-batch.
        count: what one micro-batch's target counts toward the batch's denominator, or
            None where the losses are sums (each weighs 1).
        shares: the function returns a mean over what ``count`` counts (weights are
            count / total); else a sum (weights are 1 / total).
    """

    function: LossFn
    count: Callable[[Any], float] | None
    shares: bool = False

    def total(self, targets: Sequence[Any]) -> float:
        """The batch's denominator (0 for sums, which have none)."""
        return float(sum(self.count(t) for t in targets)) if self.count is not None else 0.0

    def weights(self, targets: Sequence[Any], total: float | None = None) -> list[float]:
        """One factor per micro-batch: its loss x factor, added up, is the batch loss.

        ``total``: the denominator when ``targets`` are part of a larger batch (data-
        parallel replicas: the sum of every replica's ``total``); default, theirs alone.
        """
        if self.count is None:
            return [1.0] * len(targets)
        counts = [self.count(t) for t in targets]
        if total is None:
            total = float(sum(counts))
        if self.shares:  # nothing counted anywhere: NaN, as torch's mean of nothing
            return [c / total if total else float("nan") for c in counts]
        # A batch that counts nothing (all targets ignored) has a NaN mean, as in torch.
        factor = 1.0 / total if total else float("nan")
        return [factor] * len(counts)


def loss_rule(loss_fn: LossFn | None) -> LossRule | None:
    """The rule that makes ``loss_fn`` exact over micro-batches (see the module docstring).

    Raises:
        TypeError: ``loss_fn`` is not callable.
        ValueError: a torch loss module with ``reduction="none"``.
    """
    if loss_fn is None:
        return None
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if isinstance(loss_fn, SummedLoss):
        count = loss_fn.count
        return LossRule(loss_fn.fn, lambda target: _as_float(count(target), "SummedLoss.count"))
    if isinstance(loss_fn, nn.modules.loss._Loss):
        return _module_rule(loss_fn)
    return LossRule(loss_fn, lambda target: float(batch_size(target)), shares=True)


def _module_rule(module: nn.modules.loss._Loss) -> LossRule:
    reduction = module.reduction
    if reduction == "none":
        raise ValueError(
            f"{type(module).__name__}(reduction='none') gives a loss per element; "
            f"Pipe needs a scalar: use reduction='mean' or 'sum'"
        )
    count: Callable[[Any], float] | None = None
    if reduction == "batchmean":
        count = batch_size
    elif isinstance(module, _INDEXED):
        count = functools.partial(_indexed_count, module)
    elif isinstance(module, _ELEMENTWISE):
        count = _elements
    if reduction != "sum" and count is None:
        raise ValueError(
            f"{type(module).__name__}(reduction='mean') divides by a count Pipe cannot derive "
            f"from the targets alone, so micro-batch means would not add up to the batch's; pass "
            f"loss_fn=SummedLoss({type(module).__name__}(reduction='sum'), count=lambda target: "
            f"<what the mean divides by for that micro-batch>)"
        )
    function = ModuleLoss(module, count)
    return LossRule(function, None if reduction == "sum" else count)


class ModuleLoss:
    """A torch loss module as the last chunk calls it: a micro-batch's sum (module docstring).

    Args:
        module: the user's loss module (left as it is).
        count: what the module's mean divides by for one micro-batch's target, as the
            rule's weights count it; None where Pipe cannot tell (a module used with
            ``reduction="sum"`` only).
    """

    def __init__(self, module: nn.modules.loss._Loss, count: Callable[[Any], float] | None
                 ) -> None:
        self.module = module
        self.reduction = module.reduction
        self.summed = module if self.reduction == "sum" else _with_reduction(module, "sum")
        self.count = count
        own_forward = _overrides_forward(module)
        # A subclass's forward may reshape before torch sees the shapes: it is checked instead.
        self.broadcasts = isinstance(module, _BROADCASTING) and not own_forward
        self.checks_left = _CHECK_ATTEMPTS if own_forward and count is not None else 0

    def __call__(self, output: Any, target: Any,
                 rng_lock: threading.Lock | None = None) -> Any:
        """The micro-batch's loss: its sum, over the broadcast ratio for a mean.

        Raises:
            LossFunctionError: shapes whose broadcast pairs a row with other rows; a
                subclass whose forward does not honour ``self.reduction``.
        """
        ratio = _broadcast_ratio(self.module, output, target) if self.broadcasts else 1.0
        if self.checks_left:
            self._check_reduction(output, target, rng_lock)
        loss = self.summed(output, target)
        # The weights divide by the targets' elements; torch's mean by ratio x as many.
        return loss / ratio if ratio != 1.0 and self.reduction == "mean" else loss

    def _check_reduction(self, output: Any, target: Any, rng_lock: threading.Lock | None
                         ) -> None:
        """Refuse a forward that ignores ``self.reduction``: the sum must be mean x count."""
        assert self.count is not None
        other = "batchmean" if self.reduction == "batchmean" else "mean"
        count = float(self.count(target))
        with rng_lock if rng_lock is not None else nullcontext():
            values = _evaluate(self.module, ("sum", other), output, target)
        if values is None:  # not a scalar: the call itself reports that
            self.checks_left = 0
            return
        (total, mean), tolerance = values
        if (not (math.isfinite(total) and math.isfinite(mean))
                or math.isclose(mean, mean * count, rel_tol=tolerance)):
            self.checks_left -= 1  # this micro-batch cannot tell the two apart
            return
        if math.isclose(total, mean * count, rel_tol=tolerance):
            self.checks_left = 0
            return
        name = type(self.module).__name__
        fault = ("ignores self.reduction" if math.isclose(total, mean, rel_tol=tolerance)
                 else "does not divide by what torch's own mean would")
        raise LossFunctionError(
            f"{name} {fault}: on a micro-batch that counts {count:g} (what {name}'s "
            f"reduction='{other}' should divide by), its forward returned {total:.6g} under "
            f"reduction='sum' and {mean:.6g} under reduction='{other}'; expected the sum to be "
            f"{count:g} x {mean:.6g} = {mean * count:.6g}. Pipe calls a loss module with "
            f"reduction='sum' on each micro-batch and divides by the whole batch's count, so "
            f"its forward must honour self.reduction: pass reduction=self.reduction to the "
            f"functional loss (e.g. F.cross_entropy(..., reduction=self.reduction)) or call "
            f"super().forward; or pass loss_fn=SummedLoss(fn, count=lambda target: <what its "
            f"mean divides by>) with an fn that returns a micro-batch's sum"
        )


def microbatch_loss(loss_fn: LossFn | None, output: Any, target: Any, weight: float,
                    rng_lock: threading.Lock | None, microbatch: int, stage: int) -> torch.Tensor:
    """``loss_fn(output, target) * weight``, the last chunk's loss of one micro-batch; a
    ``ModuleLoss`` checks under ``rng_lock``.

    ``rng_lock`` guards the generator the chunk's device shares with other stage threads
    (None with one stage per process): a check restores the RNG state it found, which must
    not undo another thread's draws meanwhile.

    Raises:
        ValueError: no ``loss_fn``.
        LossFunctionError: see ``ModuleLoss.__call__``.
        StageError: ``loss_fn`` raised (naming ``stage`` and ``microbatch``).
        TypeError, ValueError: its result is no scalar tensor (``check_loss_value``).
    """
    if loss_fn is None:
        raise ValueError("step() needs a loss_fn: pass Pipe(..., loss_fn=nn.MSELoss()) or similar")
    try:
        if isinstance(loss_fn, ModuleLoss):
            loss = loss_fn(output, target, rng_lock)
        else:
            loss = loss_fn(output, target)
    except LossFunctionError:
        raise  # the loss_fn's fault, not this stage's: it names the shapes and the fix
    except Exception as error:
        raise StageError(f"stage {stage}, loss_fn, micro-batch {microbatch}: "
                         f"{type(error).__name__}: {error}") from error
    return check_loss_value(loss, microbatch, stage) * weight


def _with_reduction(module: nn.modules.loss._Loss, reduction: str) -> nn.modules.loss._Loss:
    """A shallow copy (the same parameters and buffers) with another reduction."""
    changed = copy.copy(module)
    changed.reduction = reduction
    return changed


def _overrides_forward(module: nn.Module) -> bool:
    """Whether a subclass's own forward stands between the caller and torch's loss."""
    torch_class: type[Any] = next(c for c in type(module).__mro__
                                  if c.__module__.startswith("torch."))
    return type(module).forward is not torch_class.forward


def _broadcast_ratio(module: nn.Module, output: Any, target: Any) -> float:
    """How many times the target's elements torch's mean divides by (the broadcast size's).

    Raises:
        LossFunctionError: the broadcast pairs a row with other rows, as an (n, 1) output
            against an (n,) target does: the batch's loss couples micro-batches.
    """
    if not (isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor)):
        return 1.0
    try:
        # torch declares no types for broadcast_shapes.
        shape: torch.Size = torch.broadcast_shapes(  # type: ignore[no-untyped-call]
            output.shape, target.shape)
    except RuntimeError:
        return 1.0  # the module reports the mismatch itself
    if shape == target.shape or target.numel() == 0:
        return 1.0
    # Dim 0 is the rows on both sides: with as many dims, rows meet only their own rows.
    if output.dim() != target.dim() or output.shape[0] not in (target.shape[0], 1):
        raise LossFunctionError(
            f"{type(module).__name__} broadcasts an output of shape {tuple(output.shape)} "
            f"against a target of shape {tuple(target.shape)} to {tuple(shape)}, pairing each "
            f"row with rows other than its own; over the whole batch that pairs rows of "
            f"different micro-batches, which no split reproduces. Give output and target "
            f"the same number of dims (e.g. target.unsqueeze(-1) or output.squeeze(-1)), or "
            f"pass loss_fn=SummedLoss(fn, count) with an fn that returns a micro-batch's sum"
        )
    return shape.numel() / target.numel()


def _evaluate(module: nn.modules.loss._Loss, reductions: Sequence[str], output: Any,
              target: Any) -> tuple[list[float], float] | None:
    """``module`` under each reduction, on copies, without gradients, the RNG restored.

    Returns:
        The values and a relative tolerance for their dtype, or None if one is no scalar.
    """
    output, target = _copies(output), _copies(target)
    tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    cuda = [tensors[0].device] if tensors and tensors[0].device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=cuda):
        results = [_with_reduction(module, r)(output, target) for r in reductions]
    if not all(isinstance(r, torch.Tensor) and r.numel() == 1 for r in results):
        return None
    dtype = results[0].dtype
    epsilon = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return [float(r) for r in results], max(1e-4, 16 * epsilon)


def _copies(value: Any) -> Any:
    return pytree.tree_map(
        lambda leaf: leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf, value)


def _indexed_count(module: nn.CrossEntropyLoss | nn.NLLLoss, target: torch.Tensor) -> float:
    """What torch's mean divides by for one micro-batch of class-index (or probability) targets."""
    if target.is_floating_point():
        # Class probabilities: one term per position, the class dimension (1) summed away.
        return float(target.numel() // max(1, target.shape[1] if target.dim() > 1 else 1))
    kept = target != module.ignore_index
    weight = module.weight
    if weight is None:
        return float(kept.sum())
    return float(weight.to(target.device)[target[kept]].double().sum())


def _elements(target: Any) -> float:
    if isinstance(target, torch.Tensor):
        return float(target.numel())
    raise TypeError(
        f"a loss module with reduction='mean' needs tensor targets to count their elements, "
        f"got {type(target).__name__}; pass loss_fn=SummedLoss(fn, count) to say what a micro-batch counts"
    )


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
