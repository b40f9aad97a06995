"""A micro-batch whose sizes break a guard of the trace is traced again and runs exactly: a
one-token sequence through a Llama traced on twelve, one-row micro-batches through a
mixture of experts traced on eight rows; when no new trace may be made, the refusal says why."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import units.variants
from pipeline import Pipe, StageError
from traced_models import llama, tokens


def _squares(output: Any, target: Any) -> torch.Tensor:
    return (output.logits ** 2).mean()


def _worst(model: nn.Module, plain: nn.Module) -> float:
    """The largest gradient difference, relative to the plain model's largest gradient."""
    return max(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item()
               for p, q in zip(model.parameters(), plain.parameters()) if q.grad is not None)


def test_a_one_token_sequence_runs_exactly() -> None:
    model = llama()  # llama() and tokens() as the other traced tests have them: one trace
    plain = copy.deepcopy(model)
    batch, _ = tokens()
    one, _ = tokens(length=1, seed=5, pad=0)
    with Pipe(model, chunks=2, sample=batch, devices=["cpu", "cpu"], schedule="zb-h1",
              loss_fn=_squares) as pipe:
        loss = pipe.step(one, one["input_ids"])  # breaks 'input_ids.size()[1] != 1'
        expected = _squares(plain(**one), None)
        expected.backward()
        assert abs(loss.item() - expected.item()) < 1e-10
        assert _worst(model, plain) < 1e-10
        model.zero_grad()
        plain.zero_grad()
        pipe.step(batch, batch["input_ids"])  # the first trace still runs the first sizes
        _squares(plain(**batch), None).backward()
        assert _worst(model, plain) < 1e-10


def test_one_row_micro_batches_of_a_mixture_of_experts_run_exactly() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0)
    model = MixtralForCausalLM(config)  # float32: its grouped expert kernel refuses float64
    plain = copy.deepcopy(model)
    batch = {"input_ids": torch.randint(3, 64, (8, 10), generator=torch.Generator().manual_seed(2))}
    with Pipe(model, chunks=8, sample=batch, devices=["cpu", "cpu"], schedule="1f1b",
              loss_fn=_squares) as pipe:
        loss = pipe.step(batch, batch["input_ids"])  # breaks 'input_ids.size()[0] != 1'
    expected = _squares(plain(**batch), None)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())
    assert _worst(model, plain) < 1e-4


def test_when_no_new_trace_may_be_made_the_refusal_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(units.variants, "MAX_VARIANTS", 0)
    batch, _ = tokens()
    one, _ = tokens(length=1, seed=5, pad=0)
    with Pipe(llama(), chunks=2, sample=batch, devices=["cpu", "cpu"],
              loss_fn=_squares) as pipe:
        with pytest.raises(StageError, match=r"this batch's sizes \(\(2, 1\), \(2, 1\)\) are "
                                             r"outside .* \(0 traces of other sizes are kept, "
                                             r"no more\); build the Pipe with a sample"):
            pipe.step(one, one["input_ids"])
