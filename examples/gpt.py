"""A small GPT-style language model as a flat ``nn.Sequential``, ready to be cut into stages.

Layers, in order: ``Embed`` (tokens plus learned positions), ``blocks`` x ``Block``
(pre-LayerNorm causal self-attention and a GELU MLP, each residual branch with
dropout and stochastic depth), a final ``LayerNorm``, and a bias-free ``Linear``
head whose weight *is* the token embedding's (one ``nn.Parameter`` in two layers,
so a pipeline that puts them on different stages must add both stages' gradients).

All randomness is functional (``F.dropout``, ``F.scaled_dot_product_attention``'s
``dropout_p`` and ``torch.bernoulli`` for stochastic depth), not ``nn.Dropout``
modules, so a runtime cannot find it by looking at module types.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

IGNORE_INDEX = -100  # targets with this value (padding) take no part in the loss


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth: zero a residual branch for a whole sample with probability ``p``.

    Kept samples are scaled by ``1 / (1 - p)`` so the expectation is unchanged.
    """
    if not training or p == 0.0:
        return x
    keep = torch.full((x.shape[0],) + (1,) * (x.dim() - 1), 1.0 - p, dtype=x.dtype,
                      device=x.device)
    return x * torch.bernoulli(keep) / (1.0 - p)


class Embed(nn.Module):
    """(batch, seq) token ids -> (batch, seq, dim): token plus learned position embeddings."""

    def __init__(self, vocab: int, dim: int, seq: int, dropout: float) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(seq, dim)
        self.dropout = dropout

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        hidden = self.token(tokens) + self.position(positions)
        return F.dropout(hidden, self.dropout, self.training)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions 0..t only.

    The forward takes the head count from the projections' outputs, so that under tensor
    parallelism (``tensor_parallel_plan``: query, key and value split by columns, the
    output projection by rows) each rank computes its own heads.
    """

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim must be a multiple of heads, got dim={dim}, heads={heads}")
        self.heads = heads
        self.head_dim = dim // heads
        self.dropout = dropout
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.projection = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (projection(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for projection in (self.query, self.key, self.value))
        p = self.dropout if self.training else 0.0
        mixed = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.projection(mixed.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    """x + DropPath(Dropout(Attention(LN(x)))), then the same with a GELU MLP."""

    def __init__(self, dim: int, heads: int, dropout: float, drop_path: float) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = CausalSelfAttention(dim, heads, dropout)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.dropout = dropout
        self.drop_path = drop_path

    def _branch(self, value: torch.Tensor) -> torch.Tensor:
        value = F.dropout(value, self.dropout, self.training)
        return drop_path(value, self.drop_path, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._branch(self.attention(self.attention_norm(x)))
        return x + self._branch(self.mlp(self.mlp_norm(x)))


def gpt(
    vocab: int,
    dim: int = 64,
    layers: int = 4,
    heads: int = 4,
    seq: int = 64,
    drop_path: float = 0.1,
    dropout: float = 0.1,
) -> nn.Sequential:
    """The language model: ``layers + 3`` modules, logits (batch, seq, vocab) out.

    Args:
        vocab: number of token ids.
        dim: width of the residual stream; a multiple of ``heads``.
        layers: number of transformer blocks.
        heads: attention heads per block.
        seq: the longest sequence (the number of learned positions).
        drop_path: stochastic-depth probability of each residual branch.
        dropout: dropout probability (embeddings, attention weights, branch outputs).

    Returns:
        ``nn.Sequential(Embed, Block x layers, LayerNorm, Linear)``, the head's weight
        the same ``nn.Parameter`` as the token embedding's.
    """
    embed = Embed(vocab, dim, seq, dropout)
    blocks = [Block(dim, heads, dropout, drop_path) for _ in range(layers)]
    head = nn.Linear(dim, vocab, bias=False)
    model = nn.Sequential(embed, *blocks, nn.LayerNorm(dim), head)
    for module in model.modules():  # GPT-2's initialisation: small weights, zero biases
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    head.weight = embed.token.weight  # tied: the same Parameter object
    return model


def tensor_parallel_plan(layer: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallelism for ``Distributed.from_mesh(mesh,
    tensor_parallel=...)``: in each ``Block``, attention heads and the MLP's hidden units
    split across ``tp_mesh`` (query, key, value and the MLP's first Linear by columns, the
    projections back by rows, one all-reduce each in forward and backward); embeddings,
    norms and the tied head stay whole on every rank. Between blocks the stream is a plain, replicated tensor.

    Raises:
        ValueError: a block whose heads do not divide among the ranks.
    """
    if not isinstance(layer, Block):
        return
    ranks = tp_mesh.size()
    if layer.attention.heads % ranks:
        raise ValueError(f"tensor parallelism over {ranks} ranks needs a head count divisible "
                         f"by it, got {layer.attention.heads} heads")
    parallelize_module(layer, tp_mesh, {
        "attention.query": ColwiseParallel(),
        "attention.key": ColwiseParallel(),
        "attention.value": ColwiseParallel(),
        "attention.projection": RowwiseParallel(),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(),
    })


# The same split by the model's own names (``Distributed.from_mesh(mesh,
# tensor_parallel=TENSOR_PARALLEL_BY_NAME)``): ``*`` is a block's index in the Sequential.
TENSOR_PARALLEL_BY_NAME = {
    "*.attention.query": "colwise",
    "*.attention.key": "colwise",
    "*.attention.value": "colwise",
    "*.attention.projection": "rowwise",
    "*.mlp.0": "colwise",
    "*.mlp.2": "rowwise",
}


class LanguageModelLoss(nn.CrossEntropyLoss):
    """Cross-entropy of logits (batch, seq, vocab) against targets (batch, seq).

    A ``CrossEntropyLoss`` in every attribute (``ignore_index``, ``weight``,
    ``reduction``, ``label_smoothing``); only the shapes are flattened first.
    With the default mean reduction the loss is a mean over the tokens that are
    not ``ignore_index``, so a pipeline must weight micro-batches by their tokens.
    """

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return super().forward(logits.flatten(0, -2), target.flatten())


def lm_loss(ignore_index: int = IGNORE_INDEX) -> LanguageModelLoss:
    """The language-model loss: mean cross-entropy over tokens that are not padding."""
    return LanguageModelLoss(ignore_index=ignore_index)
