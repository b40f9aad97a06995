"""bench_plan --ranks 2's setting: the models it measures, on how many ranks, at which Ms.

WORKLOADS: the uneven MLP and a small GPT, seeded, so alike on every rank; each call of a
workload's builders makes its model or batch afresh. STAGES gloo ranks, the grid's and
torch's micro-batch counts COUNTS, and TIMEOUT for the group's collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from examples.gpt import gpt, lm_loss
from examples.models import uneven_mlp

STAGES = 2
TIMEOUT = 120.0
COUNTS = (4, 8, 16)
GPT_VOCAB, GPT_SEQ = 256, 32

Batch = tuple[torch.Tensor, torch.Tensor]  # (input, target)


@dataclass(frozen=True)
class Workload:
    """A model, its batch and its loss; each call builds them afresh (a Pipe over a group
    takes its model apart)."""

    name: str
    title: str
    rows: int
    model: Callable[[], nn.Sequential]
    batch: Callable[[], Batch]
    loss: Callable[[], nn.Module]

    def build(self) -> nn.Sequential:
        torch.manual_seed(0)
        return self.model()


def _mlp_batch() -> Batch:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(256, 512, generator=generator), torch.randn(256, 10, generator=generator)


def _gpt_model() -> nn.Sequential:
    return gpt(GPT_VOCAB, dim=128, layers=6, heads=4, seq=GPT_SEQ, dropout=0.1, drop_path=0.0)


def _gpt_batch() -> Batch:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, GPT_VOCAB, (32, GPT_SEQ + 1), generator=generator)
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()


WORKLOADS = {
    "mlp": Workload("mlp", "uneven MLP (examples/models.py: 13 layers, 7 Linear + 6 ReLU, 512 "
                    "wide with one 4096-wide pair), batch 256, MSE loss", 256,
                    uneven_mlp, _mlp_batch, nn.MSELoss),
    "gpt": Workload("gpt", f"small GPT (examples/gpt.py: embedding, 6 blocks of width 128 with "
                    f"4 heads, LayerNorm, tied head; 9 layers), vocabulary {GPT_VOCAB}, batch 32 "
                    f"x {GPT_SEQ} tokens, dropout 0.1, cross-entropy", 32,
                    _gpt_model, _gpt_batch, lm_loss),
}
