"""Real models for the pipeline tests: a GPT with a tied head and a ResNet with BatchNorm.

Both are flat ``nn.Sequential`` models in float64, small enough that a pipelined step
takes a few milliseconds on a CPU, and both exercise what toy MLPs cannot:

- ``tiny_gpt``: the head's weight is the embedding's (one Parameter in the first and the
  last layer), functional randomness (dropout, stochastic depth via ``torch.bernoulli``),
  and a token-weighted loss whose targets hold ``-100`` padding, one micro-batch of
  ``gpt_batch`` entirely so.
- ``resnet``: BatchNorm (batch-coupled), in-place ReLUs (one first in a stage under
  ``resnet_balance``), and a cross-entropy with class weights and label smoothing.

``gpt(vocab, dim, layers, heads, seq, drop_path, dropout)`` and ``lm_loss`` are
examples/gpt.py's, which examples/train_gpt.py trains. The references here compute,
without a pipeline, what a pipelined step must give.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from examples.gpt import IGNORE_INDEX, gpt, lm_loss  # the full-size model and its loss

DTYPE = torch.float64
VOCAB, DIM, HEADS, SEQ, BLOCKS = 11, 8, 2, 6, 3  # 6 layers: room for 4 chunks of 2 stages
GPT_ROWS = 7  # 4 micro-batches of 2, 2, 2, 1 rows; the last row is all padding
IMAGE = (3, 8, 8)
CLASSES = 5
CNN_ROWS = 10  # 4 micro-batches of 3, 3, 2, 2 rows


def tiny_gpt(seed: int = 0, drop_path: float = 0.0, dropout: float = 0.0) -> nn.Sequential:
    """``gpt`` at test size (6 layers: Embed, 3 Blocks, LayerNorm, tied head) under ``seed``."""
    torch.manual_seed(seed)
    return gpt(VOCAB, DIM, BLOCKS, HEADS, SEQ, drop_path=drop_path, dropout=dropout).to(DTYPE)


def gpt_batch(rows: int = GPT_ROWS, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (rows, SEQ) and next-token targets with trailing ``-100`` padding.

    Row r is padded from position ``SEQ - r % 3`` on, and the last row entirely,
    so that the last of 4 micro-batches (``torch.tensor_split``) has no token to count.
    """
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=generator)
    x, target = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    for row in range(rows):
        target[row, SEQ - row % 3:] = IGNORE_INDEX
    target[-1] = IGNORE_INDEX
    return x, target


def gpt_loss() -> nn.Module:
    """Mean cross-entropy over the tokens that are not padding."""
    return lm_loss()


class BasicBlock(nn.Module):
    """ReLU(BN(conv(ReLU(BN(conv(x))))) + shortcut(x)), every ReLU in place."""

    def __init__(self, inputs: int, outputs: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.BatchNorm2d(outputs)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
        self.norm2 = nn.BatchNorm2d(outputs)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.norm2(self.conv2(self.relu(self.norm1(self.conv1(x)))))
        return self.relu(out + self.shortcut(x))


def resnet(seed: int = 0, width: int = 4) -> nn.Sequential:
    """A 9-layer ResNet: conv stem, BatchNorm, ReLU(inplace), 3 blocks, pool, flatten, Linear."""
    torch.manual_seed(seed)
    channels = IMAGE[0]
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        BasicBlock(width, width),
        BasicBlock(width, 2 * width, stride=2),
        BasicBlock(2 * width, 2 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, CLASSES),
    ).to(DTYPE)


def resnet_balance(chunks: int, layers: int = 9) -> list[int]:
    """Layers per model chunk, the first cut right before the stem's in-place ReLU (layer 2)."""
    rest, extra = divmod(layers - 2, chunks - 1)
    return [2] + [rest + (1 if c < extra else 0) for c in range(chunks - 1)]


def image_batch(rows: int = CNN_ROWS, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (rows, 3, 8, 8) in float64 and class labels."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, *IMAGE, generator=generator, dtype=DTYPE)
    return x, torch.randint(0, CLASSES, (rows,), generator=generator)


def resnet_loss() -> nn.Module:
    """Cross-entropy with unequal class weights and label smoothing (a weighted mean)."""
    weight = torch.linspace(0.5, 2.0, CLASSES, dtype=DTYPE)
    return nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)


def per_layer_parameters(model: nn.Sequential) -> dict[str, nn.Parameter]:
    """``"{layer}.{name}"`` -> Parameter, a tied Parameter once under each layer holding it."""
    return {f"{index}.{name}": parameter
            for index, layer in enumerate(model)
            for name, parameter in layer.named_parameters()}


def per_layer_grads(model: nn.Sequential) -> dict[str, torch.Tensor]:
    """The gradients under ``per_layer_parameters``' keys (zeros where there is none)."""
    return {key: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for key, p in per_layer_parameters(model).items()}


def reference_grads(
    model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor]
) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and per-layer gradients of the unpipelined model on the whole batch.

    The model is deep-copied, so the one a Pipe will train is untouched. A tied
    Parameter's full gradient appears under each layer that holds it.
    """
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    return float(loss.detach()), per_layer_grads(model)


def class_weight_of(loss_fn: nn.Module, target: torch.Tensor) -> float:
    """What a weighted-mean cross-entropy divides by: the summed weight of the counted targets."""
    counted = target[target != getattr(loss_fn, "ignore_index", IGNORE_INDEX)]
    weight = getattr(loss_fn, "weight", None)
    if weight is None:
        return float(counted.numel())
    return float(weight[counted].sum())


@dataclass(frozen=True)
class MicrobatchReference:
    """What a pipelined step of a model with BatchNorm must leave (see ``microbatch_reference``)."""

    loss: float
    grads: dict[str, torch.Tensor]  # per_layer_grads' keys
    statistics: dict[str, torch.Tensor]  # BatchNorm buffers, one update per micro-batch
    deferred_statistics: dict[str, torch.Tensor]  # one update per step (deferred_batch_norm)
    input_grad: torch.Tensor


def microbatch_reference(
    model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module, chunks: int
) -> MicrobatchReference:
    """The unpipelined model run micro-batch by micro-batch, as a pipeline with BatchNorm must.

    A batch-coupled layer (BatchNorm in training mode) normalises each micro-batch by
    its own statistics, so a pipeline cannot equal one whole-batch forward; it can equal
    this: the same micro-batches (``torch.tensor_split``) in order, each loss weighted by
    its share of the whole batch's class weight, so that without BatchNorm the sum is the
    whole-batch loss exactly. BatchNorm's running statistics either take one update per
    micro-batch, or (deferred) one per step, with the mean and unbiased variance of
    every row the layer saw in the step. For the first BatchNorm that is what one
    whole-batch forward gives; deeper ones see inputs normalised per micro-batch.
    """
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    before = _statistics(model)
    seen: dict[str, list[torch.Tensor]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.register_forward_pre_hook(
                lambda _, inputs, name=name: seen.setdefault(name, []).append(inputs[0].detach()))
    x = x.detach().clone().requires_grad_(True)
    total_weight = class_weight_of(loss_fn, y)
    total = torch.zeros((), dtype=DTYPE)
    for part_x, part_y in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)):
        output = model(part_x)  # BatchNorm counts the micro-batch even if no target does
        share = class_weight_of(loss_fn, part_y) / total_weight
        if share == 0.0:
            continue  # its mean loss is 0 / 0
        loss = loss_fn(output, part_y) * share
        loss.backward()
        total += loss.detach()
    assert x.grad is not None
    return MicrobatchReference(float(total), per_layer_grads(model), _statistics(model),
                               _deferred(model, before, seen), x.grad.clone())


def _statistics(model: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in model.state_dict().items()
            if "running" in key or "num_batches" in key}


def _deferred(model: nn.Module, before: dict[str, torch.Tensor],
              seen: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Running statistics after one momentum update per layer with all the rows it saw."""
    result = {}
    for name, module in model.named_modules():
        if name not in seen:
            continue
        rows = torch.cat(seen[name])
        dims = [d for d in range(rows.dim()) if d != 1]
        momentum = module.momentum
        result[f"{name}.running_mean"] = ((1 - momentum) * before[f"{name}.running_mean"]
                                          + momentum * rows.mean(dim=dims))
        result[f"{name}.running_var"] = ((1 - momentum) * before[f"{name}.running_var"]
                                         + momentum * rows.var(dim=dims, unbiased=True))
        result[f"{name}.num_batches_tracked"] = before[f"{name}.num_batches_tracked"] + 1
    return result


def whole_batch_statistics(model: nn.Sequential, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """BatchNorm running statistics after one training-mode forward of the whole batch."""
    model = copy.deepcopy(model).train()
    with torch.no_grad():
        model(x)
    return _statistics(model)


def difference(left: torch.Tensor, right: torch.Tensor) -> float:
    """The largest absolute element-wise difference; infinite where either holds a NaN."""
    value = float((left - right).abs().max())
    return float("inf") if math.isnan(value) else value


def grad_errors(
    model: nn.Sequential, expected: dict[str, torch.Tensor]
) -> tuple[float, list[str]]:
    """Largest gradient difference over the parameters this process holds, and their keys.

    Parameters on the ``meta`` device (another rank's layers) are skipped; a held
    parameter without a gradient counts as an infinite difference.
    """
    worst, compared = 0.0, []
    for key, parameter in per_layer_parameters(model).items():
        if parameter.is_meta:
            continue
        compared.append(key)
        if parameter.grad is None:
            worst = float("inf")
            continue
        worst = max(worst, difference(parameter.grad, expected[key]))
    return worst, compared


def buffer_error(model: nn.Sequential, expected: dict[str, torch.Tensor]) -> float:
    """Largest difference between this process's BatchNorm buffers and ``expected``."""
    worst = 0.0
    for key, value in model.state_dict().items():
        if key in expected and not value.is_meta:
            worst = max(worst, difference(value.to(DTYPE), expected[key].to(DTYPE)))
    return worst


def failure_text(error: BaseException) -> str:
    """One line naming an exception, for a table of per-combination results."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first_line}"

