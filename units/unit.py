"""One unit of a traced model: the model's own modules it reads, and its programs.

A unit holds the model's submodules (the same objects) at the paths they have in the
model, so its ``state_dict`` keys are the model's own keys, its parameters are the
model's ``Parameter`` objects, and whatever the runtime does to a module (move it to a
device, free it to ``meta``, shard it with FSDP) the unit's program sees at its next call.
It keeps programs per mode (training, evaluation): a traced graph freezes dropout's and
BatchNorm's mode, so the unit runs one traced in the root model's present mode.

Within a mode it may keep several variants, each cut from a trace of other sizes: a model
whose code branches on a size (a one-token sequence, a one-row batch) is traced again for a
micro-batch that breaks a guard of the first trace (``grow``). Every unit picks the first
variant, most recent first, whose inputs fit the values it is handed (each traced size
equal, each dynamic one in the range the trace allows, a dimension traced twice the same
both times), so that the units of one micro-batch all run the variant its first unit ran.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from units.calls import CallSpec
from units.programs import Program, constant_value


Outputs = tuple[Sequence[Any], pytree.TreeSpec]


class Unit(nn.Module):
    """Unit ``index`` of a traced model, named after the modules it runs (``name``)."""

    def __init__(self, index: int, name: str, programs: dict[bool, Program],
                 mode: Callable[[], bool], call: CallSpec | None,
                 outputs: dict[bool, Outputs] | None) -> None:
        super().__init__()
        self.index = index
        self.name = name
        self._variants: dict[bool, list[tuple[Program, Outputs | None]]] = {
            training: [(program, outputs[training] if outputs is not None else None)]
            for training, program in programs.items()}
        self._mode = mode
        self._call = call            # the first unit: how the batch is flattened
        self.lifted: set[str] = set()  # buffers of constants the trace lifted out of the code
        # The first unit's way to a trace for a micro-batch that no variant runs (or None).
        self.grow: Callable[[Any, bool], bool] | None = None
        # Every unit's way to programs of a mode it has none of (traced at first use).
        self.fill: Callable[[bool], None] | None = None

    @property
    def graphs(self) -> tuple[fx.GraphModule, ...]:
        """The traced programs it runs: per mode (training, evaluation), every variant."""
        return tuple(program.module for variants in self._variants.values()
                     for program, _ in variants)

    def replace_variants(self, training: bool, program: Program, outputs: Outputs | None
                         ) -> None:
        """Run ``program`` alone in mode ``training`` (a trace of the model at other sizes
        of its own: its tensor-parallel shards')."""
        self._variants[training] = [(program, outputs)]

    def graphs_of(self, training: bool) -> tuple[fx.GraphModule, ...]:
        """The traced programs it runs in mode ``training``."""
        return tuple(program.module for program, _ in self._variants[training])

    def drop_variants(self, training: bool) -> None:
        """Run nothing in mode ``training`` until a trace adds a variant (``grow``)."""
        self._variants[training] = []

    def add_variant(self, training: bool, program: Program, outputs: Outputs | None) -> None:
        """Run ``program`` (cut from a trace of other sizes) first where its inputs fit."""
        self._variants[training].insert(0, (program, outputs))

    def extra_repr(self) -> str:
        return f"{self.index}: {self.name}"

    def forward(self, carried: Any) -> Any:
        training = self._mode()
        values = self._call.flatten(carried) if self._call is not None else carried
        variant = self._pick(training, values)
        if variant is None and not self._variants[training] and self.fill is not None:
            self.fill(training)  # a mode dropped to be traced at first use: now
            variant = self._pick(training, values)
        if variant is None and self._grown(carried, training):
            variant = self._pick(training, values)
        if variant is None:
            raise ValueError(self._no_variant(values))
        try:
            results = self._run(variant[0], values)
        except (RuntimeError, AssertionError) as error:
            if "Guard failed" not in str(error):
                raise
            if not self._grown(carried, training):
                raise ValueError(
                    f"this batch breaks an assumption the traced graph was built on "
                    f"({str(error).splitlines()[0].strip()}; a micro-batch holds a share of "
                    f"the batch's rows): the model's code branches on that size, and no graph "
                    f"for these sizes could be made{self._refusal()}; build the Pipe with a "
                    f"sample of such sizes"
                ) from None
            variant = self._pick(training, values)
            assert variant is not None
            results = self._run(variant[0], values)
        if variant[1] is None:
            return tuple(results)
        places, spec = variant[1]
        leaves = []
        for place in places:
            constant, value = constant_value(place)
            leaves.append(value if constant else results[place])
        return pytree.tree_unflatten(leaves, spec)

    def prepare(self, carried: Any, training: bool) -> None:
        """Before a step, where the batch is given (every rank that has it): trace the sizes
        of a micro-batch that no variant runs or whose guards it breaks (the first unit),
        so that the units of later stages, on other ranks too, have its variant."""
        if not self._variants[training] and self.fill is not None:
            self.fill(training)
        values = self._call.flatten(carried) if self._call is not None else carried
        variant = self._pick(training, values)
        if variant is None or not _guards_pass(variant[0], values):
            self._grown(carried, training)  # if it cannot, the step says why

    def _run(self, program: Program, values: Sequence[Any]) -> Any:
        state = [_local(self._read(path)) for path in program.state]
        return program.module(*state, *values)

    def _pick(self, training: bool, values: Sequence[Any]
              ) -> tuple[Program, Outputs | None] | None:
        for variant in self._variants[training]:
            if fits(variant[0], values):
                return variant
        return None

    def _no_variant(self, values: Sequence[Any]) -> str:
        if self._call is not None:
            return (f"this batch's sizes ({_sizes(values)}) are outside those the traced graph "
                    f"was built for (the model's code branches on a size), and no graph for "
                    f"them could be made{self._refusal()}; build the Pipe with a sample of "
                    f"such sizes")
        return (f"unit {self.index} ({self.name}) has no traced graph for values of these "
                f"sizes ({_sizes(values)}): a micro-batch's sizes are traced before the step "
                f"on each rank that is given the batch; pass the batch to pipe.step on every "
                f"rank, or build the Pipe with a sample of such sizes")

    def _refusal(self) -> str:
        reason = getattr(self.grow, "refusal", "")
        return f" ({reason})" if reason else ""

    def _grown(self, carried: Any, training: bool) -> bool:
        """Whether a trace for this micro-batch was added (the first unit only)."""
        return self.grow is not None and self.grow(carried, training)

    def check(self, batch: Any) -> None:
        """Raise ValueError for a batch (or a list of micro-batches) the first unit refuses."""
        if self._call is None:
            raise ValueError(f"unit {self.index} ({self.name}) does not take the batch")
        for part in batch if isinstance(batch, list) else [batch]:
            self._call.flatten(part)

    def _read(self, path: str) -> Any:
        return self.read_from(self, path)

    @staticmethod
    def read_from(root: nn.Module, path: str) -> Any:
        owner: Any = root
        for part in path.split("."):
            owner = getattr(owner, part)
        return owner

    def attach(self, path: str, module: nn.Module | None = None,
               tensor: tuple[str, torch.Tensor, bool] | None = None) -> None:
        """Hold ``module`` at ``path`` (or ``tensor``: a name, the tensor, persistent)."""
        attach(self, path, module, tensor)



def _local(value: Any) -> Any:
    """A tensor-parallel parameter (a ``DTensor``) as this rank's shard, through the
    differentiable ``to_local``: the graph runs at one rank's sizes."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is not None and isinstance(value, module.DTensor):
        return value.to_local()
    return value


def fits(program: Program, values: Sequence[Any]) -> bool:
    """Whether ``values`` have the sizes ``program``'s inputs were traced with: each traced
    size equal, each dynamic one within its range and the same wherever it appears."""
    entries = _entry_values(program)
    if len(entries) != len(values):
        return False
    bound: dict[Any, int] = {}
    for traced, value in zip(entries, values):
        if not isinstance(traced, torch.Tensor) or not isinstance(value, torch.Tensor):
            continue
        if traced.dim() != value.dim():
            return False
        for size, given in zip(traced.shape, value.shape):
            if isinstance(size, int):
                if size != given:
                    return False
                continue
            expr = size.node.expr
            if not expr.is_Symbol:
                continue
            if bound.setdefault(expr, given) != given:
                return False
            allowed = size.node.shape_env.var_to_range.get(expr)
            if allowed is not None and not bool(allowed.lower <= given <= allowed.upper):
                return False
    return True


def _guards_pass(program: Program, values: Sequence[Any]) -> bool:
    """Whether ``values`` pass the guards of the trace ``program`` was cut from (the first
    unit's program calls them on the batch's leaves)."""
    guards = program.module.__dict__.get("_modules", {}).get("_guards_fn")
    positions = _guard_positions(program)
    if guards is None or positions is None:
        return True
    try:
        guards(*(values[position] for position in positions))
    except (RuntimeError, AssertionError) as error:
        if "Guard failed" in str(error):
            return False
        raise
    return True


def _guard_positions(program: Program) -> list[int] | None:
    """Which of the program's input values its guards take, in order (None: no guards);
    kept on the program."""
    if "_guard_positions" not in program.module.__dict__:
        call = next((node for node in program.module.graph.nodes
                     if node.op == "call_module" and node.target == "_guards_fn"), None)
        placeholders = [n for n in program.module.graph.nodes if n.op == "placeholder"]
        position = {node: index - len(program.state) for index, node in enumerate(placeholders)}
        program.module.__dict__["_guard_positions"] = None if call is None else [
            position[arg] for arg in call.args]
    found: list[int] | None = program.module.__dict__["_guard_positions"]
    return found


def _entry_values(program: Program) -> list[Any]:
    """The traced (fake) values of a program's inputs after its state, kept on the program."""
    found = program.module.__dict__.get("_entry_values")
    if found is None:
        placeholders = [n for n in program.module.graph.nodes if n.op == "placeholder"]
        found = [n.meta.get("val") for n in placeholders[len(program.state):]]
        program.module.__dict__["_entry_values"] = found
    return found


def _sizes(values: Sequence[Any]) -> str:
    return ", ".join(str(tuple(v.shape)) for v in values if isinstance(v, torch.Tensor))


def attach(root: nn.Module, path: str, module: nn.Module | None = None,
           tensor: tuple[str, torch.Tensor, bool] | None = None) -> None:
    """Hold ``module`` at ``path`` under ``root`` (or ``tensor``: a name, the tensor,
    persistent, on the module at ``path``), creating plain holders for the path's parents."""
    parts = path.split(".") if path else []
    owner: nn.Module = root
    for part in parts[:-1] if module is not None else parts:
        child = owner._modules.get(part)
        if child is None:
            child = _Holder()
            owner.add_module(part, child)
        owner = child
    if module is not None:
        owner.add_module(parts[-1], module)
        return
    assert tensor is not None
    name, value, persistent = tensor
    if isinstance(value, nn.Parameter):
        owner.register_parameter(name, value)
    else:
        owner.register_buffer(name, value, persistent=persistent)


class _Holder(nn.Module):
    """A plain module standing for one of the model's modules on the path to what a unit
    holds (the model's own module is not held whole: it holds other units' parts too)."""


def held(unit: nn.Module) -> Iterator[tuple[str, nn.Module | None,
                                           tuple[str, torch.Tensor, bool] | None]]:
    """What ``unit`` holds of the model, as ``attach`` took it: (path, module, None) for a
    module held whole, (path, None, (name, tensor, persistent)) for a tensor."""
    yield from _held(unit, "")


def _held(module: nn.Module, prefix: str
          ) -> Iterator[tuple[str, nn.Module | None, tuple[str, torch.Tensor, bool] | None]]:
    for name, value in module._parameters.items():
        if value is not None:
            yield prefix.rstrip("."), None, (name, value, True)
    for name, buffer in module._buffers.items():
        if buffer is not None and not (isinstance(module, Unit) and name in module.lifted):
            yield prefix.rstrip("."), None, (name, buffer,
                                             name not in module._non_persistent_buffers_set)
    for name, child in module._modules.items():
        if child is None:
            continue
        if isinstance(child, _Holder):
            yield from _held(child, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", child, None
