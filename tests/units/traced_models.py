"""Models as people write them, for the tracing tests: tiny Hugging Face configs with random
weights (nothing downloaded), and a loop over a ModuleList with a side input and a long skip."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipeline import SummedLoss

VOCAB = 64


def llama(layers: int = 4, seed: int = 0) -> nn.Module:
    """A tiny LlamaForCausalLM: rotary, grouped-query attention, a head tied to the embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).double()


def gpt2(layers: int = 4, seed: int = 0) -> nn.Module:
    """A tiny GPT2LMHeadModel (dropout off, so that it can be compared exactly)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=layers, n_head=2, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(config).double()


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.gate = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return h + self.mix(self.norm(h)) * torch.sigmoid(self.gate(h)) * scale


class Looped(nn.Module):
    """A loop over a ModuleList: a side input computed once (``scale``, read by every
    block), a long skip from the stem to the head, keyword arguments."""

    def __init__(self, width: int = 8, depth: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(2 * width, 3)
        self.double()

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        skip = h
        scale = torch.sigmoid(weight).unsqueeze(-1)
        for block in self.blocks:
            h = block(h, scale)
        return self.head(torch.cat([h, skip], dim=-1))


def tokens(rows: int = 4, length: int = 12, seed: int = 1, pad: int = 3) -> tuple[dict[str, Any], torch.Tensor]:
    """A batch as Hugging Face models take it (right padding on row 1) and its labels
    (-100 on the padding)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, length), generator=generator)
    mask = torch.ones(rows, length, dtype=torch.long)
    if pad:
        mask[1, -pad:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask}, labels


def looped_batch(rows: int = 4, seed: int = 1) -> tuple[dict[str, Any], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8, generator=generator, dtype=torch.float64)
    weight = torch.randn(rows, generator=generator, dtype=torch.float64)
    return {"x": x, "weight": weight}, torch.randn(rows, 3, generator=generator, dtype=torch.float64)


def lm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the non-padding tokens (with ``token_count``)."""
    logits = output.logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                           reduction="sum")


def token_count(labels: torch.Tensor) -> torch.Tensor:
    return (labels[:, 1:] != -100).sum()


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def reference(model: nn.Module, batch: dict[str, Any], target: torch.Tensor, kind: str
              ) -> tuple[float, dict[str, torch.Tensor]]:
    """The plain model's loss and gradients (by its own names) on the whole batch."""
    model.zero_grad()
    output = model(**batch)
    loss = lm_loss(output, target) / token_count(target) if kind != "looped" else mse(output, target)
    loss.backward()
    return loss.item(), {name: p.grad.clone()
                         for name, p in model.named_parameters(remove_duplicate=False)}


MODELS = {"llama": (llama, tokens), "gpt2": (gpt2, tokens), "looped": (Looped, looped_batch)}


def build(kind: str) -> tuple[nn.Module, dict[str, Any], torch.Tensor]:
    factory, batch_of = MODELS[kind]
    batch, target = batch_of()
    return factory(), batch, target


def loss_options(kind: str) -> dict[str, Any]:
    if kind == "looped":
        return {"loss_fn": mse}
    return {"loss_fn": SummedLoss(lm_loss, token_count)}
