"""Tensor-parallel plans by the model's own names: which module splits how across ``tp``.

A plan maps module names (the model's own, as ``named_modules`` lists them; ``*`` stands
for one part of a name, a layer's index) to a style:

- ``"colwise"``: a Linear's (or Hugging Face ``Conv1D``'s) output features split; its
  input arrives whole on every rank.
- ``"rowwise"``: its input features split; the ranks' partial outputs are summed (one
  all-reduce), then the bias is added once.
- ``"packed_colwise"``: ``"colwise"`` for a weight that packs several projections along its
  output: each pack splits on its own. How many it packs is read from the module that
  holds it where that says (GPT-2's attention splits ``c_attn``'s output by its
  ``split_size``: 3 packs, q, k and v), else 2 (a fused gate and up projection, as in
  Hugging Face's plans); ``Style("packed_colwise", packs=3)`` says it outright.
- ``"replicated_with_grad_allreduce"``: parameters kept whole on every rank but applied to a
  split value (Qwen3's per-head ``q_norm``): their gradients are summed over ``tp``.

``"auto"`` is the plan a Hugging Face config ships (``base_model_tp_plan``), its names
resolved under the base model's attribute (``model.layers.*`` in ``LlamaForCausalLM``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from torch import nn

STYLES = ("colwise", "rowwise", "packed_colwise", "replicated_with_grad_allreduce")
SPLITTING = ("colwise", "rowwise", "packed_colwise")
V = TypeVar("V")


@dataclass(frozen=True)
class Style:
    """How one module splits: ``name`` one of ``STYLES``; ``packs``, for
    ``"packed_colwise"``, how many projections its weight packs."""

    name: str
    packs: int | None = None  # "packed_colwise": None reads it from the model (resolve_plan)

    def __post_init__(self) -> None:
        if self.name not in STYLES:
            raise ValueError(f"unknown tensor-parallel style {self.name!r}; expected one of "
                             f"{', '.join(STYLES)}")
        if self.packs is not None and self.packs < 1:
            raise ValueError(f"Style({self.name!r}, packs={self.packs}): expected packs >= 1")

    @property
    def parts(self) -> int:
        """How many pieces of its split dimension one rank's share is made of."""
        return (self.packs or 2) if self.name == "packed_colwise" else 1


PlanSpec = str | Mapping[str, "str | Style"]


def resolve_plan(model: nn.Module, plan: PlanSpec) -> dict[str, Style]:
    """Each module ``plan`` names in ``model``, by its name, and its style.

    Raises:
        ValueError: ``"auto"`` for a model whose config ships no plan; another string; a
            pattern that matches no module; a style that is not one of ``STYLES``; one
            module given two styles.
    """
    patterns = _patterns(model, plan)
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, Style] = {}
    for pattern, given in patterns.items():
        style = given if isinstance(given, Style) else _style(pattern, given)
        for name in modules_matching(model, pattern, "tensor-parallel plan", names):
            style = _with_packs(model, name, style)
            if resolved.setdefault(name, style) != style:
                raise ValueError(f"tensor-parallel plan: module {name!r} is given two styles, "
                                 f"{resolved[name].name!r} and {style.name!r}")
    return resolved


def modules_matching(model: nn.Module, pattern: str, plan: str,
                     names: list[str] | None = None) -> list[str]:
    """The names of ``model``'s modules that ``pattern`` matches (``*``: one part of a name).

    Raises:
        ValueError: it matches none (``plan`` says which plan asked).
    """
    names = names if names is not None else [name for name, _ in model.named_modules() if name]
    expression = re.compile(r"[^.]+".join(re.escape(part) for part in pattern.split("*")))
    matched = [name for name in names if expression.fullmatch(name)]
    if not matched:
        raise ValueError(
            f"{plan}: {pattern!r} matches no module of {type(model).__name__} (its modules "
            f"are named like {names[:3]}; '*' stands for one part of a name, e.g. "
            f"'model.layers.*.mlp.up_proj')")
    return matched


def _with_packs(model: nn.Module, name: str, style: Style) -> Style:
    """``style`` with its pack count, for ``"packed_colwise"`` where none was given: the
    ratio of the module's output width to a width its holder splits it by
    (``split_size``, ``embed_dim``, ``hidden_size``: GPT-2's attention), else 2."""
    if style.name != "packed_colwise" or style.packs is not None:
        return style
    module = model.get_submodule(name)
    width = getattr(module, "out_features", None) or getattr(module, "nf", None)
    holder = model.get_submodule(name.rpartition(".")[0])
    for attribute in ("split_size", "embed_dim", "hidden_size"):
        part = getattr(holder, attribute, None)
        if isinstance(width, int) and type(part) is int and 0 < part < width \
                and width % part == 0:
            return Style(style.name, packs=width // part)
    return Style(style.name, packs=2)


def _style(pattern: str, given: object) -> Style:
    if not isinstance(given, str):
        raise ValueError(f"tensor-parallel plan: {pattern!r} -> {given!r}: expected a style "
                         f"name ({', '.join(STYLES)}) or a Style")
    if given not in STYLES:
        raise ValueError(f"tensor-parallel plan: {pattern!r} has style {given!r}, which is "
                         f"not one of {', '.join(STYLES)}")
    return Style(given)


def _patterns(model: nn.Module, plan: PlanSpec) -> Mapping[str, str | Style]:
    if isinstance(plan, Mapping):
        if not plan:
            raise ValueError("tensor-parallel plan: an empty dict splits nothing; name the "
                             "modules to split, or leave the mesh without a 'tp' dimension")
        return plan
    if plan != "auto":
        raise ValueError(f"tensor_parallel={plan!r}: expected 'auto', a dict of module "
                         f"names to styles, or fn(layer, tp_mesh)")
    config = getattr(model, "config", None)
    shipped = getattr(config, "base_model_tp_plan", None)
    if not shipped:
        raise ValueError(
            f"tensor_parallel='auto' reads the plan a Hugging Face config ships "
            f"(config.base_model_tp_plan); {type(model).__name__} has "
            f"{'no config' if config is None else 'none in its config'}: pass a dict of "
            f"module names to styles")
    return under_base_model(model, shipped)


def under_base_model(model: nn.Module, shipped: Mapping[str, V]) -> dict[str, V]:
    """A plan a Hugging Face config ships (names under its base model) by ``model``'s own
    names: under the base model's attribute (``model.`` in ``LlamaForCausalLM``)."""
    prefix = getattr(model, "base_model_prefix", "")
    under = prefix if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    return {f"{under}.{pattern}" if under else pattern: style
            for pattern, style in shipped.items()}
