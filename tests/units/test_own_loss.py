"""The model's own loss: ``pipe.step(batch)`` with ``labels`` in the batch and no loss_fn
trains on ``output.loss``, weighted by each micro-batch's share of the counted labels, so
that loss and gradients equal the plain model's on the whole batch (float64, right padding
of a different length in every micro-batch, a micro-batch of padding only)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipeline import Pipe
from traced_models import VOCAB, llama, tokens

TOLERANCE = 1e-10
PADDING = (0, 3, 5, 1, 9, 2, 11, 11)  # per row; rows 6-7 (the last micro-batch) all padding


def padded(padding: tuple[int, ...] = PADDING, length: int = 11) -> dict[str, torch.Tensor]:
    """A right-padded batch as Hugging Face models take it, labels -100 on the padding."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (len(padding), length), generator=generator)
    mask = torch.ones(len(padding), length, dtype=torch.long)
    for row, pad in enumerate(padding):
        if pad:
            mask[row, length - pad:] = 0
    return {"input_ids": ids, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


def causal_loss_in_float64(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                           **kwargs: Any) -> torch.Tensor:
    """Hugging Face's ForCausalLMLoss without its cast of the logits to float32."""
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.view(-1, vocab_size), shifted.reshape(-1), ignore_index=-100)


def _plain(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    plain = copy.deepcopy(model)
    loss = plain(**batch).loss
    loss.backward()
    return loss.item(), {name: p.grad for name, p in plain.named_parameters()}


def _worst(model: nn.Module, expected: dict[str, torch.Tensor]) -> float:
    return max(float((p.grad - expected[name]).abs().max()) for name, p in model.named_parameters())


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_models_own_loss_equals_the_plain_models_on_the_whole_batch(schedule: str) -> None:
    model = llama(3)
    model.loss_function = causal_loss_in_float64  # the loss in float64 too: exact to 1e-10
    batch = padded()
    loss_expected, grads_expected = _plain(model, batch)
    with Pipe(model, chunks=4, schedule=schedule, sample=batch, devices=["cpu", "cpu"]) as pipe:
        loss = pipe.step(batch)
    assert abs(loss.item() - loss_expected) < TOLERANCE
    assert _worst(model, grads_expected) < TOLERANCE


def test_hugging_faces_own_loss_in_float32_agrees_to_float32s_precision() -> None:
    """Hugging Face computes the loss in float32, whatever the model's dtype: its value and
    the gradients it sends back agree to float32's precision."""
    model = llama(2)
    batch = padded(PADDING[:6])
    loss_expected, grads_expected = _plain(model, batch)
    with Pipe(model, chunks=3, sample=batch, devices=["cpu", "cpu"]) as pipe:
        loss = pipe.step(batch)
    assert abs(loss.item() - loss_expected) < 1e-6 * abs(loss_expected)
    assert _worst(model, grads_expected) < 1e-6


def test_a_batch_without_labels_is_refused_naming_the_fix() -> None:
    model = llama(2)
    batch = padded(PADDING[:6])
    with Pipe(model, chunks=3, sample=batch, devices=["cpu", "cpu"]) as pipe:
        with pytest.raises(ValueError, match="holding 'labels'"):
            pipe.step({key: value for key, value in batch.items() if key != "labels"})
        assert all(p.grad is None for p in model.parameters())


def test_without_labels_in_the_sample_a_step_still_needs_a_loss_fn() -> None:
    model, (batch, _) = llama(), tokens()  # the trace test_traced_exact caches
    with Pipe(model, chunks=2, sample=batch, devices=["cpu", "cpu"]) as pipe:
        with pytest.raises(ValueError, match="needs a loss_fn"):
            pipe.step(batch)
