"""Expert-parallel plans by the model's own names: which modules hold experts, checked and sharded over ``ep``.

An experts module is what Hugging Face's MoE models call ``mlp.experts``: ``forward(hidden
(tokens, width), top_k_index (tokens, k), top_k_weights (tokens, k)) -> (tokens, width)``,
the sum over each token's k picks of the picked expert's output times its weight, and
every parameter of its own a stack with one slice per expert along dimension 0
(``gate_up_proj`` (experts, 2 * inner, width), ``down_proj`` (experts, width, inner)). A
module written by hand to that interface is one too.

A plan maps module names (``*``: one part of a name) to a style: ``"ep_dispatch_experts"``
(or ``"experts"``) marks an experts module; ``"grouped_gemm"`` marks one of its
parameters, which is what the module's style implies already. ``"auto"`` is the plan a
Hugging Face config ships (``base_model_ep_plan``).

``shard_experts`` makes each experts module's parameters ``DTensor`` shards over the
``ep`` mesh (``Shard(0)``: rank r holds experts ``r * E/ep`` to ``(r + 1) * E/ep - 1``),
each rank slicing its own from the whole tensor it holds: the model's names keep the
model's tensors, so a state dict gathers them whole and a whole tensor loads into them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from units.tp_plan import modules_matching, under_base_model

EXPERTS_STYLES = ("ep_dispatch_experts", "experts")
PARAMETER_STYLES = ("grouped_gemm",)
ExpertPlan = str | Mapping[str, str]  # "auto" or {module name pattern: style}


def resolve_expert_plan(model: nn.Module, plan: ExpertPlan) -> list[str]:
    """The names of the experts modules ``plan`` marks in ``model``.

    Raises:
        ValueError: ``"auto"`` for a model whose config ships no plan; another string; a
            pattern that matches no module; a style that is not one of
            ``EXPERTS_STYLES`` or ``PARAMETER_STYLES``; a ``"grouped_gemm"`` parameter
            whose module is not marked.
    """
    patterns = _patterns(model, plan)
    names = [name for name, _ in model.named_modules() if name]
    experts: list[str] = []
    parameters: list[str] = []
    for pattern, style in patterns.items():
        if style in EXPERTS_STYLES:
            experts += [name for name in modules_matching(model, pattern, "expert-parallel plan",
                                                          names) if name not in experts]
        elif style in PARAMETER_STYLES:
            parameters.append(pattern)
        else:
            raise ValueError(f"expert-parallel plan: {pattern!r} has style {style!r}, which is "
                             f"not one of {', '.join(EXPERTS_STYLES + PARAMETER_STYLES)}")
    for pattern in parameters:
        holder = pattern.rpartition(".")[0]
        if not set(modules_matching(model, holder, "expert-parallel plan", names)) <= set(experts):
            raise ValueError(f"expert-parallel plan: {pattern!r} is 'grouped_gemm', but its "
                             f"module {holder!r} is not marked 'ep_dispatch_experts'")
    if not experts:
        raise ValueError("expert-parallel plan: it marks no experts module "
                         "('ep_dispatch_experts'); name the modules that hold the experts")
    return experts


def expert_count(name: str, module: nn.Module) -> int:
    """How many experts ``module`` holds: its ``num_experts``, else its first parameter's
    leading size.

    Raises:
        ValueError: a module with no parameters of its own, or with parameters in
            submodules, or whose parameters are not stacked by expert along dimension 0.
    """
    own = dict(module.named_parameters(recurse=False))
    nested = [key for key, _ in module.named_parameters() if key not in own]
    if not own or nested:
        raise ValueError(
            f"expert parallelism: {name!r} ({type(module).__name__}) is not an experts "
            f"module: expected parameters of its own stacked by expert along dimension 0 "
            f"(gate_up_proj, down_proj), got "
            f"{f'parameters in submodules ({nested[:3]})' if nested else 'none'}")
    declared = getattr(module, "num_experts", None)
    count = declared if isinstance(declared, int) else next(iter(own.values())).shape[0]
    unstacked = {key: tuple(tensor.shape) for key, tensor in own.items()
                 if tensor.dim() < 2 or tensor.shape[0] != count}
    if unstacked:
        raise ValueError(f"expert parallelism: {name!r} holds {count} experts, but its "
                         f"parameters {unstacked} are not stacked one slice per expert along "
                         f"dimension 0")
    return count


def check_expert_split(model: nn.Module, names: list[str], ep: int) -> None:
    """Raise ValueError, before anything is sharded, for an experts module ``ep`` ranks
    cannot share: its expert count not divisible by ``ep``, or no experts module at all."""
    for name in names:
        count = expert_count(name, model.get_submodule(name))
        if count % ep:
            raise ValueError(f"expert parallelism: {name!r} holds {count} experts, which "
                             f"ep={ep} ranks cannot share evenly; use an ep that divides "
                             f"{count}")
        every = [tensor for _, tensor in model.named_parameters(remove_duplicate=False)]
        tied = [key for key, tensor in model.get_submodule(name).named_parameters(recurse=False)
                if sum(other is tensor for other in every) > 1]
        if tied:
            raise ValueError(f"expert parallelism: {name!r}'s parameters {tied} are tied to "
                             f"others; an expert's weights must be its own")


def shard_experts(model: nn.Module, names: list[str], ep_mesh: Any,
                  local: set[str] | None = None) -> None:
    """Make each experts module's parameters (of modules in ``local``, default all)
    ``DTensor`` shards over ``ep_mesh`` along dimension 0; modules on ``meta`` are left."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    for name in names:
        if local is not None and name not in local:
            continue
        module = model.get_submodule(name)
        for key, tensor in list(module.named_parameters(recurse=False)):
            if tensor.is_meta or isinstance(tensor, DTensor):
                continue
            sharded = distribute_tensor(tensor.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(key, nn.Parameter(sharded,
                                                        requires_grad=tensor.requires_grad))


def _patterns(model: nn.Module, plan: ExpertPlan) -> Mapping[str, str]:
    if isinstance(plan, Mapping):
        if not plan:
            raise ValueError("expert-parallel plan: an empty dict marks no experts; name the "
                             "experts modules, or leave the mesh without an 'ep' dimension")
        return plan
    if plan != "auto":
        raise ValueError(f"expert_parallel={plan!r}: expected 'auto' or a dict of module "
                         f"names to 'ep_dispatch_experts'")
    config = getattr(model, "config", None)
    shipped = getattr(config, "base_model_ep_plan", None)
    if not shipped:
        raise ValueError(
            f"expert_parallel='auto' reads the plan a Hugging Face config ships "
            f"(config.base_model_ep_plan); {type(model).__name__} has "
            f"{'no config' if config is None else 'none in its config'}: pass a dict of "
            f"module names to 'ep_dispatch_experts'")
    return under_base_model(model, shipped)
