"""A model as the pipeline runs it: its units, their names, and the model's own keys.

Every model becomes a ``Cut``, built in one place (``cut_of``). An ``nn.Sequential`` is the
trivial case: its layers are the units, each at its index in the model. Any other module
is traced and cut (``units.traced.TracedCut``): each unit holds the model's own modules at
the paths they have in the model. Either way a unit's state sits at one place in the model
(``"3"`` for a Sequential's layer 3, the root for a traced unit), so every key a Cut
answers is the model's own (``"3.weight"``, ``"model.layers.2.mlp.up_proj.weight"``): the
state dict, a stage's share, ties and strict loading all use that one namespace, and
nothing translates keys at a boundary.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import fx, nn

from units.tp_plan import PlanSpec, resolve_plan
from units.unit import attach, held

# A tensor-parallel plan: "auto", {module name pattern: style}, or fn(layer, tp_mesh).
TensorParallelPlan = PlanSpec | Callable[[nn.Module, Any], None]


@dataclass(frozen=True)
class UnitInfo:
    """What one unit runs: its index, name, the model's modules and parameter names, and
    (from ``pipe.units``, once the model is cut into stages) the model chunk and stage that
    run it."""

    index: int
    name: str
    modules: tuple[str, ...]
    parameters: tuple[str, ...]
    chunk: int | None = None
    stage: int | None = None


class Cut:
    """``units`` (an ``nn.Sequential``: what runs, one module a unit) of ``model``, and the
    model's own keys. This class is a Sequential's cut: nothing to check, nothing refused."""

    def __init__(self, model: nn.Module, units: nn.Sequential, infos: Sequence[UnitInfo],
                 places: Sequence[str]) -> None:
        self.model = model
        self.units = units
        self.infos = tuple(infos)
        self._places = tuple(places)  # where each unit's state sits in the model
        self._order = {key: i for i, key in enumerate(model.state_dict(keep_vars=True))}

    @classmethod
    def of_sequential(cls, model: nn.Sequential) -> Cut:
        """A Sequential's cut: each layer a unit, named by its index (or its own name)."""
        names = list(model._modules)
        infos = [UnitInfo(index, name, (name,),
                          tuple(f"{name}.{key}" for key, _ in layer.named_parameters()))
                 for index, (name, layer) in enumerate(zip(names, model))]
        return cls(model, model, infos, names)

    def __len__(self) -> int:
        return len(self.units)

    # -- what a traced cut checks (nothing, here) ---------------------------------------

    def check_model(self) -> None:
        """Raise ValueError, before a step, if the model changed in a way the cut cannot run."""

    def check_batch(self, batch: Any) -> None:
        """Raise ValueError, before a step, for a batch the first unit would refuse."""

    def prepare(self, microbatches: Sequence[Any]) -> None:
        """Make ready, before a step, for micro-batches of these sizes."""

    def check_options(self, deferred_batch_norm: bool) -> None:
        """Raise ValueError for a Pipe option this cut cannot honour."""

    @property
    def takes_batch_as_written(self) -> bool:
        """Whether the first unit takes the batch as the model does (a dict of keyword
        arguments, ``labels`` included) rather than a Sequential's tensors."""
        return False

    def rewrite(self, rewrite: Callable[[fx.GraphModule], Any]) -> None:
        """Apply a pass to every traced program of the cut, and of later traces (none here)."""

    # -- keys ---------------------------------------------------------------------------

    def check_split(self, plan: TensorParallelPlan, tp: int) -> None:
        """Raise ValueError for a plan ``parallelize`` would refuse, before anything is split
        or freed (a function plan is the user's: nothing to check).

        Raises:
            ValueError: as ``parallelize``.
        """
        if not callable(plan):
            self._torch_styles(resolve_plan(self.model, plan))

    def parallelize(self, plan: TensorParallelPlan, tp_mesh: Any, indices: Sequence[int],
                    timeout: float | None = None) -> Any:
        """Split units ``indices`` over ``tp_mesh``: ``fn(layer, tp_mesh)`` on each, or by
        a dict of the model's module names (``"3.attn.q"``) to ``"colwise"`` and
        ``"rowwise"``, applied with torch's ``ColwiseParallel`` and ``RowwiseParallel``
        (each layer runs as it is written, so its code must reshape with ``-1`` where a
        size is split). Returns None (a traced cut returns what counts its all-reduces).

        Raises:
            ValueError: ``"auto"``, or another style, for a Sequential's layers.
        """
        if callable(plan):
            for index in indices:
                plan(self.units[index], tp_mesh)
            return None
        from torch.distributed.tensor.parallel import parallelize_module

        styles = resolve_plan(self.model, plan)
        torch_styles = self._torch_styles(styles)
        for index in indices:
            prefix = f"{self._places[index]}."
            own = {name.removeprefix(prefix): torch_styles[style.name]()
                   for name, style in styles.items() if name.startswith(prefix)}
            if own:
                parallelize_module(self.units[index], tp_mesh, own)
        return None

    def check_expert_split(self, plan: Any, ep: int) -> None:
        """Raise ValueError: a Sequential's layers are not traced, so no experts module of
        theirs can become a token exchange (a traced cut spreads them)."""
        raise ValueError("expert parallelism spreads the experts modules of a traced model: "
                         "give the Pipe the model as it is written, not an nn.Sequential")

    def parallelize_experts(self, plan: Any, ep_mesh: Any, indices: Sequence[int],
                            timeout: float | None = None) -> Any:
        """As ``check_expert_split``: refused for a Sequential."""
        self.check_expert_split(plan, ep_mesh.size())

    @staticmethod
    def _torch_styles(styles: dict[str, Any]) -> dict[str, Any]:
        """torch's style class for each of ``styles``' names.

        Raises:
            ValueError: a style other than ``"colwise"`` and ``"rowwise"``.
        """
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        known = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        refused = {name: style.name for name, style in styles.items()
                   if style.name not in known}
        if refused:
            raise ValueError(
                f"a Sequential's layers run as written, split by torch's ColwiseParallel and "
                f"RowwiseParallel: styles 'colwise' and 'rowwise' only, got {refused}")
        return known

    def key(self, index: int, name: str) -> str:
        """The model's key of ``name`` in unit ``index``'s own state dict."""
        place = self._places[index]
        return f"{place}.{name}" if place and name else place or name

    def named_state(self, indices: Sequence[int] | None = None, keep_vars: bool = False
                    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(the model's key, tensor) of what ``indices`` (default: every unit) hold, each
        key once, in the model's order."""
        found: dict[str, torch.Tensor] = {}
        for index in self._indices(indices):
            for name, tensor in self.units[index].state_dict(keep_vars=keep_vars).items():
                found.setdefault(self.key(index, name), tensor)
        end = len(self._order)
        yield from sorted(found.items(), key=lambda item: self._order.get(item[0], end))

    def state_dict(self, indices: Sequence[int] | None = None, keep_vars: bool = False
                   ) -> dict[str, torch.Tensor]:
        """The state of units ``indices`` (default: all) under the model's own keys."""
        return dict(self.named_state(indices, keep_vars))

    def keys(self, indices: Sequence[int] | None = None) -> frozenset[str]:
        """The model's keys that units ``indices`` (default: all) hold."""
        return frozenset(key for key, _ in self.named_state(indices, keep_vars=True))

    def parameter_keys(self, indices: Sequence[int] | None = None) -> dict[int, str]:
        """``id`` of each parameter units ``indices`` hold -> its model key (for messages)."""
        found: dict[int, str] = {}
        for index in self._indices(indices):
            for name, parameter in self.units[index].named_parameters():
                found.setdefault(id(parameter), self.key(index, name))
        return found

    @cached_property
    def ties(self) -> tuple[tuple[str, ...], ...]:
        """The model's keys of each parameter it holds under several keys (a head tied to
        the embedding); read once, before any rank frees what it does not run."""
        keys: dict[int, list[str]] = {}
        for index in range(len(self.units)):
            for name, parameter in self.units[index].named_parameters(remove_duplicate=False):
                keys.setdefault(id(parameter), []).append(self.key(index, name))
        groups = (tuple(dict.fromkeys(names)) for names in keys.values())
        return tuple(dict.fromkeys(group for group in groups if len(group) > 1))

    def view(self, indices: Sequence[int]) -> nn.Module:
        """A module holding what units ``indices`` hold, under the model's own names, each
        object once (the module a checkpoint of a stage's share reads and writes)."""
        found = nn.Module()
        seen: set[int] = set()
        for index in indices:
            place, unit = self._places[index], self.units[index]
            if place:
                if id(unit) not in seen:
                    seen.add(id(unit))
                    attach(found, place, module=unit)
                continue
            for path, module, tensor in held(unit):
                key = id(module) if module is not None else id(tensor[1]) if tensor else 0
                if key not in seen:
                    seen.add(key)
                    attach(found, path, module, tensor)
        return found

    def load_state_dict(self, state: dict[str, Any], indices: Sequence[int] | None = None,
                        strict: bool = True) -> None:
        """Load ``state`` (the model's keys) into units ``indices`` (default: all); keys of
        other units are skipped.

        Checked alike wherever it runs, so that every rank raises or none does: with
        ``strict``, missing and unexpected keys (of the whole model where ``state`` holds
        keys of other units); always, a state that gives one tied parameter two values.

        Raises:
            ValueError: keys missing or unexpected (strict), or a tie the state would break.
        """
        self.check_ties_kept(state)
        chosen = self._indices(indices)
        if strict:
            self.check_keys(state, chosen)
        for index in chosen:
            unit = self.units[index]
            held_now = unit.state_dict(keep_vars=True)
            own = {name: _like_held(state[key], held_now[name]) for name in held_now
                   if (key := self.key(index, name)) in state}
            unit.load_state_dict(own, strict=strict)

    def check_ties_kept(self, state: dict[str, Any]) -> None:
        """Raise ValueError where ``state`` gives one tied parameter two values, naming both
        keys: each stage would keep the copy it loaded, while their gradients are still
        summed as one."""
        for names in self.ties:
            given = [name for name in names if name in state]
            first = state[given[0]] if given else None
            for name in given[1:]:
                other = state[name]
                if not (isinstance(first, torch.Tensor) and isinstance(other, torch.Tensor)
                        and first.shape == other.shape and torch.equal(first, other)):
                    raise ValueError(
                        f"load_state_dict: {given[0]!r} and {name!r} are one parameter in "
                        f"this model (tied), but the state gives them different values; load "
                        f"a state saved from the tied model, or set both keys to the same "
                        f"tensor")

    def check_keys(self, state: dict[str, Any], indices: Sequence[int]) -> None:
        """Raise ValueError unless ``state`` has exactly the keys it should: a state with
        keys beyond ``indices``' (a whole model's, loaded on every rank) the whole model's,
        one of only their keys (what a rank's ``pipe.state_dict()`` saved) theirs."""
        local = self.keys(indices)
        expected = local if set(state) <= local else self.keys()
        missing = sorted(expected - set(state))
        unexpected = sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(
                f"load_state_dict(strict=True): expected the whole model's keys; missing "
                f"{missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected "
                f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")

    def _indices(self, indices: Sequence[int] | None) -> Sequence[int]:
        return range(len(self.units)) if indices is None else indices


def _like_held(value: Any, held_tensor: Any) -> Any:
    """``value`` (a whole tensor) as the DTensor shard ``held_tensor`` is, where it is one
    (tensor-parallel or FSDP shards: each rank slices its own, no communication)."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None or not isinstance(held_tensor, module.DTensor) \
            or not isinstance(value, torch.Tensor) or isinstance(value, module.DTensor):
        return value
    return module.distribute_tensor(value.to(held_tensor.device), held_tensor.device_mesh,
                                    held_tensor.placements, src_data_rank=None)
