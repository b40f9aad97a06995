"""One unit of a traced model: the model's own modules it reads, and its programs.

A unit holds the model's submodules (the same objects) at the paths they have in the
model, so its ``state_dict`` keys are the model's own keys, its parameters are the
model's ``Parameter`` objects, and whatever the runtime does to a module (move it to a
device, free it to ``meta``, shard it with FSDP) the unit's program sees at its next call.
It keeps one program per mode (training, evaluation): a traced graph freezes dropout's
and BatchNorm's mode, so the unit runs the one traced in the root model's present mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from units.calls import CallSpec
from units.programs import Program, constant_value


class Unit(nn.Module):
    """Unit ``index`` of a traced model, named after the modules it runs (``name``)."""

    def __init__(self, index: int, name: str, programs: dict[bool, Program],
                 mode: Callable[[], bool], call: CallSpec | None,
                 outputs: dict[bool, tuple[Sequence[Any], pytree.TreeSpec]] | None) -> None:
        super().__init__()
        self.index = index
        self.name = name
        self._programs = programs
        self._mode = mode
        self._call = call            # the first unit: how the batch is flattened
        self._outputs = outputs      # the last unit: how the model's output is rebuilt
        self.lifted: set[str] = set()  # buffers of constants the trace lifted out of the code

    @property
    def graphs(self) -> tuple[fx.GraphModule, ...]:
        """The traced programs it runs: one per mode (training, evaluation)."""
        return tuple(program.module for program in self._programs.values())

    def extra_repr(self) -> str:
        return f"{self.index}: {self.name}"

    def forward(self, carried: Any) -> Any:
        training = self._mode()
        program = self._programs[training]
        state = [self._read(path) for path in program.state]
        values = self._call.flatten(carried) if self._call is not None else carried
        if len(values) != len(program.entry):
            raise ValueError(f"unit {self.index} ({self.name}) takes {len(program.entry)} "
                             f"values, got {len(values)}")
        try:
            results = program.module(*state, *values)
        except (RuntimeError, AssertionError) as error:
            if "Guard failed" not in str(error):
                raise
            raise ValueError(
                f"this batch breaks an assumption the traced graph was built on "
                f"({str(error).splitlines()[0].strip()}; a micro-batch holds a share of the "
                f"batch's rows): the model's code branches on that size, so the graph traced "
                f"for the sample cannot run it; build the Pipe with a sample of such sizes"
            ) from None
        if self._outputs is None:
            return tuple(results)
        places, spec = self._outputs[training]
        leaves = []
        for place in places:
            constant, value = constant_value(place)
            leaves.append(value if constant else results[place])
        return pytree.tree_unflatten(leaves, spec)

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

    def held(self) -> Iterator[tuple[str, nn.Module | None, tuple[str, torch.Tensor, bool] | None]]:
        """What this unit holds of the model, as ``attach`` took it: (path, module, None)
        for a module held whole, (path, None, (name, tensor, persistent)) for a tensor."""
        yield from _held(self, "")


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
