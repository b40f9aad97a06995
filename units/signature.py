"""What a traced graph took from the model besides its tensors, so that a change is seen.

A graph freezes more than the model's code: every attribute its forward read (a flag, a list
of gains, a function held in an attribute, ``Dropout.p``, a norm's ``eps``, the config, a
plain tensor attribute, lifted as a constant), which module stood at each name, instance
``forward``s, forward hooks, and the mode of every submodule. ``ModelState.of(model)``
captures all of it, and ``differences`` says in words what changed:

- with ``same_object=False`` (``same_make``), whether a trace of one model describes another
  (a copy on another rank, a fresh model of the same make): types and values, module
  references by their path in the model;
- with ``same_object=True``, whether the model a Pipe traced was changed since: the same, and
  every module, function and hook by identity, so that a module replaced by an equal one, or
  a hook removed and another added at the same address, is seen.

Values are kept, not their ``id()``: a reference held here keeps its object alive, so an
address is never reused for something else. Mutable values (lists, dicts, configs) are
copied as they were.

A private attribute (``_name``) added since is not a difference: the trace cannot have read
it, and libraries keep their bookkeeping there (FSDP's ``_is_fsdp_managed_module``).

What it cannot see: globals and closures the forward reads (a trace freezes them too), and
objects more than ``_DEPTH`` attributes away from a module.
"""

from __future__ import annotations

import enum
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

_DEPTH = 4
_SMALL_TENSOR = 1 << 16  # plain tensor attributes up to this many elements are compared by value

# nn.Module's own bookkeeping: compared as tensors, children and hooks, not as attributes.
_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"forward"}
_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                  "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                  "_backward_hooks", "_backward_pre_hooks")
_PLAIN = (bool, int, str, bytes, type(None), complex, torch.dtype, torch.device, torch.layout,
          torch.memory_format, enum.Enum, torch.Size)
_EXACT_PLAIN = frozenset({bool, int, str, bytes, type(None), torch.dtype, torch.device})


class _Same:
    """An object compared by identity (held, so that its address is never reused)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)

    def __repr__(self) -> str:
        return f"<{_describe(self.value)}>"


class _TensorValue:
    """A plain tensor attribute: shape, dtype and device, and its values when small."""

    __slots__ = ("shape", "dtype", "device", "values", "tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = tuple(tensor.shape), tensor.dtype, tensor.device
        small = tensor.numel() <= _SMALL_TENSOR and not tensor.is_meta
        self.values = tensor.detach().clone() if small else None
        self.tensor = None if small else tensor
        self.version = tensor._version

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _TensorValue) or (self.shape, self.dtype, self.device) != (
                other.shape, other.dtype, other.device):
            return False
        if self.values is not None and other.values is not None:
            return bool(torch.equal(self.values, other.values))
        return other.tensor is self.tensor and other.version == self.version

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype))

    def __repr__(self) -> str:
        return f"Tensor{self.shape}:{str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class _ModuleEntry:
    name: str
    module: _Same
    kind: type
    tensors: tuple[tuple[str, Any], ...]      # parameter and buffer names, and dtypes (or None)
    attributes: tuple[tuple[str, Any], ...]   # every other attribute, frozen
    forward: Any                              # an instance forward (frozen), or None
    hooks: tuple[tuple[str, tuple[Any, ...]], ...]


@dataclass(frozen=True)
class ModelState:
    """Everything of ``model`` a traced graph depends on but its tensors' values."""

    modules: tuple[_ModuleEntry, ...]
    global_hooks: tuple[tuple[Any, ...], ...]

    @classmethod
    def of(cls, model: nn.Module) -> ModelState:
        named = list(model.named_modules(remove_duplicate=False))
        freezer = _Freezer(named)
        entries = tuple(freezer.module(name, module) for name, module in named)
        global_hooks = tuple(tuple(map(freezer.value, table.values())) for table in (
            module_hooks._global_forward_pre_hooks, module_hooks._global_forward_hooks,
            module_hooks._global_backward_hooks, module_hooks._global_backward_pre_hooks))
        return cls(entries, global_hooks)

    def same_make(self, other: ModelState) -> bool:
        """Whether a trace of the model ``self`` was taken of describes ``other``'s."""
        return not self.differences(other, same_object=False, first=True)

    def differences(self, now: ModelState, same_object: bool, first: bool = False
                    ) -> list[str]:
        """What differs from ``self`` in ``now``, in words (``first``: stop at one)."""
        found: list[str] = []
        if self.global_hooks != now.global_hooks:
            found.append("the global module hooks (nn.modules.module.register_module_forward_"
                         "hook and the like) changed")
        before = {entry.name: entry for entry in self.modules}
        after = {entry.name: entry for entry in now.modules}
        for name in after.keys() - before.keys():
            found.append(f"a module was added at {_path(name)} "
                         f"({after[name].kind.__name__})")
        for name in before.keys() - after.keys():
            found.append(f"the module at {_path(name)} was removed")
        for name, old in before.items():
            if first and found:
                break
            new = after.get(name)
            if new is not None:
                found.extend(_entry_differences(old, new, same_object))
        return found[:1] if first else found


def modes(model: nn.Module) -> tuple[bool, ...]:
    """Every submodule's ``training`` flag, in ``named_modules`` order."""
    return tuple(module.training for module in model.modules())


def mode_differences(model: nn.Module, traced: tuple[bool, ...]) -> list[str]:
    """The submodules whose mode differs from the one the graph was traced in."""
    found = []
    for (name, module), was in zip(model.named_modules(), traced):
        if module.training != was:
            found.append(f"{_path(name)} is in {_mode_name(module.training)} mode, traced in "
                         f"{_mode_name(was)} mode")
    return found


def _entry_differences(old: _ModuleEntry, new: _ModuleEntry, same_object: bool) -> list[str]:
    where = _path(old.name)
    if old.kind is not new.kind:
        return [f"{where} is now a {new.kind.__name__} (traced: {old.kind.__name__})"]
    if same_object and old.module != new.module:
        return [f"{where} was replaced by another {new.kind.__name__}"]
    found = []
    if old.tensors != new.tensors:
        found.append(f"{where}'s parameters and buffers are now {_names(new.tensors)} "
                     f"(traced: {_names(old.tensors)})")
    if old.forward != new.forward:
        found.append(f"{where}.forward was replaced" if new.forward is not None else
                     f"{where}'s instance forward was removed")
    if old.hooks != new.hooks:
        before_hooks, after_hooks = dict(old.hooks), dict(new.hooks)
        changed = [kind for kind in _FORWARD_HOOKS
                   if before_hooks.get(kind, ()) != after_hooks.get(kind, ())]
        found.append(f"{where}'s hooks changed ({', '.join(changed)})")
    if old.attributes != new.attributes:
        before, after = dict(old.attributes), dict(new.attributes)
        for key in dict.fromkeys([*before, *after]):
            if key not in before and key.startswith("_"):
                continue  # bookkeeping added since (FSDP's flags): the trace never read it
            if before.get(key, _MISSING) != after.get(key, _MISSING):
                found.append(f"{where}.{key} is {_shown(after.get(key, _MISSING))} "
                             f"(traced: {_shown(before.get(key, _MISSING))})")
    return found


class _Missing:
    def __repr__(self) -> str:
        return "unset"


_MISSING = _Missing()


class _Freezer:
    """Freezes attribute values; references to the model's own modules become their paths."""

    def __init__(self, named: list[tuple[str, nn.Module]]) -> None:
        self.paths: dict[int, str] = {}
        for name, module in named:
            self.paths.setdefault(id(module), name)
        self.memo: dict[int, Any] = {}

    def module(self, name: str, module: nn.Module) -> _ModuleEntry:
        state = vars(module)
        tensors = tuple((key, None if value is None else value.dtype)
                        for table in (module._parameters, module._buffers)
                        for key, value in table.items())
        attributes = tuple((key, self.value(value)) for key, value in state.items()
                           if key not in _MODULE_INTERNALS)
        forward = state.get("forward")
        frozen_forward = None if forward is None or getattr(
            forward, "runs_the_class_forward", False) else self.value(forward)
        hooks = tuple((key, tuple(map(self.value, state[key].values())))
                      for key in _FORWARD_HOOKS if state.get(key))
        return _ModuleEntry(name, _Same(module), type(module), tensors, attributes,
                            frozen_forward, hooks)

    def value(self, value: Any, depth: int = 0) -> Any:
        kind = type(value)  # not isinstance: a config's __getattribute__ would run each time
        if kind in _EXACT_PLAIN:
            return (kind, value)
        if kind is float:
            return (float, repr(value))  # nan equals nan
        key = id(value)
        frozen = self.memo.get(key)
        if frozen is None:
            frozen = self.memo[key] = self._unseen(value, kind, depth)
        return frozen

    def _unseen(self, value: Any, kind: type, depth: int) -> Any:
        if issubclass(kind, _PLAIN):
            return (kind, value)
        if issubclass(kind, float):
            return (kind, repr(value))
        if issubclass(kind, torch.Tensor):
            return _TensorValue(value)
        if issubclass(kind, nn.Module):
            path = self.paths.get(id(value))
            return ("module", path) if path is not None else ("module", _Same(value))
        if kind is types.MethodType:
            return ("method", value.__func__, self.value(value.__self__, depth + 1))
        if issubclass(kind, (types.FunctionType, types.BuiltinFunctionType, type,
                             types.ModuleType)) or depth >= _DEPTH:
            return _Same(value)
        if issubclass(kind, (list, tuple, set, frozenset, dict)):
            return self._container(value, depth)
        if hasattr(value, "__dict__") and not callable(value):
            return self._object(value, depth)
        return _Same(value)

    def _container(self, value: Any, depth: int) -> Any:
        if isinstance(value, dict):
            return (type(value), tuple((self.value(k, depth + 1), self.value(v, depth + 1))
                                       for k, v in value.items()))
        items = tuple(self.value(item, depth + 1) for item in value)
        return (type(value), frozenset(items) if isinstance(value, (set, frozenset)) else items)

    def _object(self, value: Any, depth: int) -> Any:
        self.memo[id(value)] = ("cycle", type(value))
        return ("object", type(value), tuple(
            (name, self.value(item, depth + 1)) for name, item in vars(value).items()))


def _path(name: str) -> str:
    return name or "the model"


def _mode_name(training: bool) -> str:
    return "training" if training else "evaluation"


def _names(tensors: tuple[tuple[str, Any], ...]) -> list[str]:
    return [f"{name}:{str(dtype).removeprefix('torch.')}" for name, dtype in tensors
            if dtype is not None]


def _shown(frozen: Any) -> str:
    text = _unfrozen(frozen)
    return text if len(text) <= 80 else text[:77] + "..."


def _unfrozen(frozen: Any) -> str:
    if isinstance(frozen, tuple) and len(frozen) == 2 and isinstance(frozen[0], type):
        kind, value = frozen
        if kind in (list, tuple, set, frozenset):
            return repr(kind(_Shown(_unfrozen(item)) for item in value))
        if kind is dict:
            return "{" + ", ".join(f"{_unfrozen(k)}: {_unfrozen(v)}" for k, v in value) + "}"
        return value if kind is float else repr(value)
    if isinstance(frozen, tuple) and frozen and frozen[0] == "object":
        return f"a {frozen[1].__name__} with other values"
    if isinstance(frozen, tuple) and frozen and frozen[0] == "module":
        return frozen[1] if isinstance(frozen[1], str) else repr(frozen[1])
    if isinstance(frozen, tuple) and frozen and frozen[0] == "method":
        return f"<method {frozen[1].__qualname__}>"
    return repr(frozen)


class _Shown(str):
    def __repr__(self) -> str:
        return str(self)


def _describe(value: Any) -> str:
    name = getattr(value, "__name__", None) or type(value).__name__
    return f"{getattr(value, '__module__', None) or ''}.{name}".lstrip(".")

