"""The model's own loss: ``pipe.step(batch)`` where ``model(**batch)`` returns ``.loss``.

A Hugging Face model called with ``labels`` returns its loss, the mean over the
label positions that count (not -100; for a causal LM, after the shift by one).
Each micro-batch's ``output.loss`` is the mean over *its* positions, so the Pipe
weights it by its share of the whole batch's counted positions: the weighted sum
is the whole batch's mean, whatever padding each micro-batch holds. The count is
taken as Hugging Face's Trainer takes it for ``num_items_in_batch``: the labels
after the first position for a decoder-only causal LM, all of them otherwise.

A micro-batch with no position that counts (all -100) has a loss of 0 / 0 in the
model; its weight is 0, and the Pipe backpropagates an exact zero through its
output instead of that NaN, as the whole batch's mean would count nothing there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from pipeline.compute.loss import LossRule

IGNORED = -100  # Hugging Face's ignore_index for labels


def labels_of(batch: Any) -> Any:
    """The batch's ``labels`` where it is a dict of keyword arguments holding them, else None."""
    if isinstance(batch, Mapping):
        return batch.get("labels")
    return None


def shifts_labels(model: nn.Module) -> bool:
    """Whether the model's loss predicts label i + 1 at position i (a causal LM), as Hugging
    Face's Trainer decides it for ``num_items_in_batch``."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return False
    config = getattr(model, "config", None)
    loss_type = getattr(model, "loss_type", None)
    causal = isinstance(loss_type, str) and LOSS_MAPPING.get(loss_type) is ForCausalLMLoss
    return causal and not getattr(config, "is_encoder_decoder", False)


class LabelCount:
    """What a micro-batch's ``output.loss`` averages over: its labels that are not -100."""

    def __init__(self, shifted: bool) -> None:
        self.shifted = shifted

    def __call__(self, labels: Any) -> float:
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"the model's own loss needs batch['labels'] to be a tensor, got "
                            f"{type(labels).__name__}")
        counted = labels[..., 1:] if self.shifted else labels
        return float((counted != IGNORED).sum())


class OwnLoss:
    """``output.loss`` of one micro-batch (the Pipe's target is its ``labels``)."""

    def __init__(self, count: LabelCount) -> None:
        self.count = count

    def __call__(self, output: Any, labels: Any) -> torch.Tensor:
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if not isinstance(loss, torch.Tensor):
            raise ValueError(
                f"the Pipe has no loss_fn, so it trains on the model's own loss, but the model "
                f"returned no .loss (got {type(output).__name__}); pass labels in the batch to "
                f"a model that computes its loss, or build the Pipe with loss_fn=...")
        if self.count(labels) == 0:
            return _zero_through(output, loss)
        return loss


def _zero_through(output: Any, loss: torch.Tensor) -> torch.Tensor:
    """An exact zero whose backward reaches the model's outputs with zero gradients (the
    model's own loss of a micro-batch that counts nothing is 0 / 0)."""
    tensors = [t for t in pytree.tree_leaves(output)
               if isinstance(t, torch.Tensor) and t.requires_grad and t is not loss
               and t.is_floating_point()]
    zero = loss.detach().new_zeros(())
    for tensor in tensors:
        zero = zero + tensor.sum() * 0.0
    return zero


def own_loss_rule(model: nn.Module, as_written: bool, sample: Any) -> LossRule | None:
    """The rule for a Pipe built without ``loss_fn`` whose model takes the batch as it is
    written (``Cut.takes_batch_as_written``: a traced model) and a sample holding
    ``labels``: micro-batch losses weighted by their share of the counted labels. None
    where that does not hold (the Pipe then needs a ``loss_fn`` to train)."""
    if not as_written or labels_of(sample[0] if isinstance(sample, list) else sample) is None:
        return None
    count = LabelCount(shifts_labels(model))
    return LossRule(OwnLoss(count), count, shares=True)


def own_loss_target(batch: Any, in_process: bool) -> Any:
    """The target a step with the model's own loss runs with: the batch's ``labels`` (the
    loss weights count them; the last chunk's ``OwnLoss`` reads them).

    Raises:
        ValueError: in one process, a batch without labels.
    """
    labels = labels_of(batch)
    if labels is None and in_process:
        raise ValueError(
            f"the Pipe has no loss_fn, so a step trains on the model's own loss, which needs "
            f"the batch as a dict holding 'labels'; got {type(batch).__name__} without them: "
            f"pass batch['labels'], or build the Pipe with loss_fn=... and pass a target")
    return labels


def check_labels_on_last(targets: Any, stage: int | None, last: int) -> None:
    """Raise ValueError on the rank of the last chunk if it was given no labels (its loss
    weights count them).

    Args:
        targets: this rank's micro-batch targets (the labels), or None.
        stage: this rank's stage (None in one process).
        last: the stage of the last chunk.
    """
    if targets is None and stage == last:
        raise ValueError(
            f"the Pipe trains on the model's own loss: stage {last} (this rank) weights each "
            f"micro-batch's loss by its share of the labels, so it needs the batch too; "
            f"pass pipe.step(batch) on this rank as well (with batch['labels'])")
