"""A planned module's parameters as tensor-parallel shards, and the model as one rank sees it.

``check_splittable`` refuses, before anything is sharded, a plan the model cannot take (a
head count or ``num_key_value_heads`` not divisible by ``tp``, a split dimension of
another size, a module of a kind no style splits, a planned weight tied to another).
``shard_parameters`` turns each planned module's weight and bias into a ``DTensor``
parameter over the ``tp`` mesh, each rank slicing its own shard from the whole tensor it
holds (no communication): the model's names keep the model's tensors, sharded, so a state
dict gathers them whole and a whole tensor loads into them. ``localized`` is a copy of
the model on ``meta`` with each planned module at one rank's sizes, for tracing: the
graph then reshapes, views and expands at local head counts.

A weight's output features sit in dimension 0 for an ``nn.Linear`` and in dimension 1 for
Hugging Face's ``Conv1D`` (a weight stored (in, out), its width in ``nf``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from units.tp_plan import SPLITTING, Style
from units.variants import on_meta as copy_on_meta

# config attribute -> the planned modules whose outputs it counts, by their last name part
_HEAD_COUNTS = {"num_attention_heads": ("q_proj", "c_attn", "qkv_proj", "query"),
                "num_key_value_heads": ("k_proj", "v_proj", "key", "value")}


def output_dim(name: str, module: nn.Module) -> int:
    """The dimension of ``module``'s weight that holds its output features.

    Raises:
        ValueError: a module that is neither an ``nn.Linear`` nor a ``Conv1D``.
    """
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.Linear):
        return 0
    if isinstance(getattr(module, "nf", None), int) and isinstance(weight, torch.Tensor) \
            and weight.dim() == 2 and weight.shape[1] == module.nf:
        return 1
    raise ValueError(f"tensor parallelism splits nn.Linear and Conv1D layers; {name!r} is a "
                     f"{type(module).__name__}")


def check_splittable(model: nn.Module, styles: dict[str, Style], tp: int) -> None:
    """Raise ValueError, naming the module, the dimension and ``tp``, for a plan that cannot
    split ``model`` over ``tp`` ranks.

    Raises:
        ValueError: a head count not divisible by ``tp``; a split dimension whose size (or a
            pack's) is not; a splitting style on something other than a Linear or Conv1D; a
            planned parameter tied to another name.
    """
    config = getattr(model, "config", None)
    for attribute, projections in _HEAD_COUNTS.items():
        count = getattr(config, attribute, None)
        planned = [name for name, style in styles.items() if style.name in SPLITTING
                   and name.rsplit(".", 1)[-1] in projections]
        if isinstance(count, int) and planned and count % tp:
            raise ValueError(
                f"config.{attribute}={count} is not divisible by tp={tp}: {planned[0]!r} "
                f"holds {count} heads, which cannot split evenly over {tp} ranks; use a tp "
                f"that divides {count}")
    aliases = _aliases(model)
    for name, style in styles.items():
        module = model.get_submodule(name)
        for tensor_name, tensor in module.named_parameters(recurse=False):
            names = aliases.get(id(tensor), [])
            if len(names) > 1:
                raise ValueError(f"tensor-parallel plan: {name}.{tensor_name} is tied to "
                                 f"{[n for n in names if n != f'{name}.{tensor_name}']}; a "
                                 f"tied parameter cannot be split by one of its modules")
        if style.name not in SPLITTING:
            continue
        dim = output_dim(name, module) if style.name != "rowwise" \
            else 1 - output_dim(name, module)
        size = _weight(module).shape[dim]
        parts = tp * style.parts
        if size % parts:
            what = (f"{style.parts} packs of {size // style.parts}"
                    if style.name == "packed_colwise" else f"{size}")
            raise ValueError(
                f"{name!r} ({style.name}) splits its weight's dimension {dim} ({what}) over "
                f"tp={tp}: not divisible")


def placements(name: str, module: nn.Module, style: Style, tensor_name: str
               ) -> list[Any]:
    """The ``tp`` placement of ``module``'s parameter ``tensor_name`` under ``style``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if style.name == "replicated_with_grad_allreduce":
        return [Replicate()]
    if tensor_name == "bias" and style.name == "rowwise":
        return [Replicate()]
    dim = 0 if tensor_name == "bias" else output_dim(name, module)
    if style.name == "rowwise":
        return [Shard(1 - dim)]
    if style.parts > 1:
        return [_StridedShard(dim, split_factor=style.parts)]
    return [Shard(dim)]


def shard_parameters(model: nn.Module, styles: dict[str, Style], tp_mesh: Any,
                     names: set[str] | None = None) -> None:
    """Make each planned module's parameters (of those in ``names``, default all) DTensor
    shards over ``tp_mesh``; modules on ``meta`` are left as they are."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, style in styles.items():
        if style.name == "replicated_with_grad_allreduce" or (names is not None
                                                               and name not in names):
            continue
        module = model.get_submodule(name)
        for tensor_name, tensor in list(module.named_parameters(recurse=False)):
            if tensor.is_meta or isinstance(tensor, DTensor):
                continue
            sharded = distribute_tensor(tensor.detach(), tp_mesh,
                                        placements(name, module, style, tensor_name),
                                        src_data_rank=None)
            module.register_parameter(
                tensor_name, nn.Parameter(sharded, requires_grad=tensor.requires_grad))


def localized(model: nn.Module, styles: dict[str, Style], tp: int) -> nn.Module:
    """A copy of ``model`` on ``meta`` at one rank's sizes: each split weight (and bias) of
    a planned module is its shard's size, a ``Conv1D``'s ``nf`` its local width, and an
    integer attribute of a packed module's parent that equals one pack's width (GPT-2's
    ``split_size``, with which it splits the packed output) is the local pack's width."""
    on_meta = copy_on_meta(model)
    for name, style in styles.items():
        if style.name not in SPLITTING:
            continue
        module = on_meta.get_submodule(name)
        out = output_dim(name, model.get_submodule(name))
        for tensor_name, tensor in list(module.named_parameters(recurse=False)):
            dim = 0 if tensor_name == "bias" else (1 - out if style.name == "rowwise" else out)
            if tensor_name == "bias" and style.name == "rowwise":
                continue
            whole = model.get_submodule(name).get_parameter(tensor_name).shape[dim]
            if tensor.shape[dim] != whole:
                continue  # already a shard's size (the model's own was sharded)
            shape = list(tensor.shape)
            shape[dim] = whole // tp
            module.register_parameter(tensor_name, nn.Parameter(
                torch.empty(shape, dtype=tensor.dtype, device="meta"),
                requires_grad=tensor.requires_grad))
        if style.name != "rowwise" and out == 1:
            setattr(module, "nf", int(getattr(module, "nf")) // tp)  # Conv1D's output width
        if style.name == "packed_colwise":
            _localize_pack_widths(on_meta, name, _weight(module).shape[out] * tp // style.parts,
                                  tp)
    return on_meta


def _localize_pack_widths(on_meta: nn.Module, name: str, width: int, tp: int) -> None:
    parent = on_meta.get_submodule(name.rpartition(".")[0])
    for attribute, value in list(vars(parent).items()):
        if not attribute.startswith("_") and type(value) is int and value == width:
            setattr(parent, attribute, width // tp)


def _weight(module: nn.Module) -> torch.Tensor:
    weight = getattr(module, "weight")
    assert isinstance(weight, torch.Tensor)
    return weight


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        found.setdefault(id(tensor), []).append(name)
    return found
