"""Model factories for the CLI tests: imported by ``pipe-balance`` in a subprocess."""

from __future__ import annotations

import torch
from torch import nn


def mlp() -> nn.Sequential:
    """Twelve small layers with one wide Linear, so a good cut differs from the uniform one."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
        nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 32), nn.ReLU(),
        nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 8),
    )


def tiny_llama() -> nn.Module:
    """A Hugging Face LlamaForCausalLM from a tiny config (random weights, nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2))


def not_sequential() -> nn.Module:
    return nn.Linear(4, 4)


def empty() -> nn.Sequential:
    return nn.Sequential()


NOT_CALLABLE = 3


def in_place() -> nn.Sequential:
    """In-place layers after the first: profiling must not feed them a leaf."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 32), nn.ReLU(inplace=True), nn.Linear(32, 32),
        nn.Dropout(0.1, inplace=True), nn.Linear(32, 8),
    )


def tied() -> nn.Sequential:
    """An embedding and a head sharing one weight: its bytes count once."""
    torch.manual_seed(0)
    embedding = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, nn.Linear(16, 16), nn.ReLU(), head)


def exits() -> nn.Sequential:
    """A factory that exits instead of returning: status 0 must not pass for success."""
    import sys

    sys.exit(0)


def three() -> nn.Sequential:
    """Three layers: the CLI tests give them costs where min-max and the makespan disagree."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
