"""Capture a model's forward once as a graph (``torch.export``), sizes left dynamic.

Every dimension of every tensor input is ``Dim.AUTO`` (but those of size one in the sample,
which stay one: that is how inputs broadcast): export keeps a dimension symbolic unless the
model's code fixes it, and records a guard where the code branches on a size, so another
batch size or sequence length runs the same graph or is refused by that guard, never run
down a branch frozen for the traced size. Sizes are traced "size-oblivious", so that a
traced batch of 8 rows also runs micro-batches of one row (a sample of one row fixes the
batch at one: trace with more).

Why ``ep.module()`` and not ``torch.export.unflatten``: the former runs on the model's own
``Parameter`` objects (so an optimizer built on ``model.parameters()`` trains what runs),
the latter builds new ones.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch import nn
from torch.export import Dim
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from units.calls import CallSpec, as_call
from units.ep_dispatch import opaque_experts
from units.errors import TraceError
from units.signature import ModelState
from units.programs import is_subgraph


_KEPT_TRACES = 16


def export_model(model: nn.Module, sample: Any, modes: tuple[bool, ...],
                 opaque: tuple[str, ...] = ()) -> tuple[torch.fx.GraphModule, CallSpec]:
    """``model``'s forward on ``sample``, each submodule in the mode ``modes`` gives it (in
    ``model.modules()`` order), as a graph (``_export``), kept for the next model of the
    same make: a trace costs seconds, and a Pipe built on a copy of a model (every rank and
    every test builds one) would pay it again. The programs cut from it read the model's
    tensors by name at each call, so a trace serves every model whose modules, tensors'
    names, shapes and dtypes, attributes of any type, instance forwards, hooks, modes and
    config are the same (``ModelState.same_make``); anything else is traced anew. The last
    ``_KEPT_TRACES`` are kept, without the tensors of the model they were traced on.

    ``opaque`` names experts modules (``units.ep_plan``) traced as one call each
    (``units.ep_dispatch``): what they compute inside is not traced (a loop over the
    experts a token picked, which a graph cannot follow), and the call can become a token
    exchange."""
    key = (_fingerprint(model, sample, modes), opaque)
    state = ModelState.of(model)
    for index, (kept_key, kept_state, trace) in enumerate(_TRACES):
        if kept_key == key and kept_state.same_make(state):
            _TRACES.append(_TRACES.pop(index))  # most recently used last
            return trace
    traced = opaque_experts(_sharing_tensors(model), list(opaque)) if opaque else model
    graph_module, call = _export(traced, sample, modes)
    _TRACES.append((key, state, (_without_model_state(graph_module), call)))
    del _TRACES[:-_KEPT_TRACES]
    return _TRACES[-1][2]


_TRACES: list[tuple[Any, ModelState, tuple[torch.fx.GraphModule, CallSpec]]] = []


def _sharing_tensors(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules that holds the model's own tensors.

    Raises:
        TraceError: the modules cannot be copied.
    """
    try:
        return copy.deepcopy(model, {id(tensor): tensor for tensor in
                                     [*model.parameters(), *model.buffers()]})
    except Exception as error:  # deepcopy raises what the objects it copies raise
        raise TraceError(
            f"tracing {type(model).__name__}'s experts modules as one call each traces a copy "
            f"of its modules (holding its own tensors), and copying them failed: "
            f"{type(error).__name__}: {error}") from error


def _fingerprint(model: nn.Module, sample: Any, modes: tuple[bool, ...]) -> Any:
    """The sample's structure and tensors, the model's tensors and ties, and the modes: what
    a trace depends on that is cheap to compare (``ModelState`` holds the rest)."""
    leaves, structure = pytree.tree_flatten(as_call(sample))
    described = tuple((tuple(leaf.shape), leaf.dtype, leaf.device) if isinstance(leaf, torch.Tensor)
                      else (type(leaf), repr(leaf)) for leaf in leaves)
    tensors = tuple((name, tuple(tensor.shape), tensor.dtype, tensor.device,
                     isinstance(tensor, nn.Parameter), tensor.requires_grad) for name, tensor in
                    [*model.named_parameters(remove_duplicate=False),
                     *model.named_buffers(remove_duplicate=False)])
    ties = tuple(sorted(_ties(model)))
    return (modes, str(structure), described, tensors, ties)


def _check_no_backward_hooks(model: nn.Module) -> None:
    """A graph runs a module's ops, never the module: backward hooks on a module would not
    run, so they are refused rather than silently dropped."""
    from torch.nn.modules import module as module_hooks

    hooked = [name or type(model).__name__ for name, module in model.named_modules()
              if module._backward_hooks or module._backward_pre_hooks]
    if module_hooks._global_backward_hooks or module_hooks._global_backward_pre_hooks:
        hooked.append("(global module backward hooks)")
    if hooked:
        raise TraceError(
            f"{type(model).__name__} has module backward hooks on {hooked[:4]}, which a traced "
            f"graph does not run (it calls the modules' ops, not the modules): register "
            f"tensor hooks on parameters instead (they run), or give the Pipe an "
            f"nn.Sequential of your blocks"
        )


class _RefuseTensorHooks(TorchFunctionMode):
    """Refuses ``Tensor.register_hook`` on a non-parameter: entered in the tracing thread
    only. torch's function modes are a per-thread stack and ``register_hook`` consults it
    (``__torch_function__``), so the class and every other thread, a re-trace's stages
    registering hooks meanwhile included, are left as they are."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model_name = type(model).__name__

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _REGISTER_HOOK and args and not isinstance(args[0], nn.Parameter):
            filename, line, text = _caller_of_register_hook()
            raise TraceError(
                f"{self.model_name}'s forward registers a tensor hook at {filename}:{line} "
                f"({text}), which a traced graph cannot keep: register it on a parameter, "
                f"or give the Pipe an nn.Sequential of your blocks"
            )
        return func(*args, **kwargs)


_REGISTER_HOOK = torch.Tensor.register_hook


def _caller_of_register_hook() -> tuple[str, int | None, str | None]:
    """Where the forward called ``register_hook``: the innermost frame outside torch and
    this module (torch's ``register_hook`` and the modes export keeps on the stack, which
    call it again, stand between it and this mode)."""
    stack = traceback.extract_stack()
    for frame in reversed(stack):
        if not frame.filename.startswith(_TORCH_FILES) and frame.filename != __file__:
            return frame.filename, frame.lineno, frame.line
    return stack[0].filename, stack[0].lineno, stack[0].line


_TORCH_FILES = os.path.dirname(torch.__file__) + os.sep


@contextlib.contextmanager
def _refusing_tensor_hooks(model: nn.Module) -> Iterator[None]:
    """A forward that registers a tensor hook (``h.register_hook(...)``) would lose it in
    the graph, silently: while this thread traces, such a call is an error naming where it
    was made (``_RefuseTensorHooks``)."""
    with _RefuseTensorHooks(model):
        yield


def _ties(model: nn.Module) -> list[tuple[str, ...]]:
    names: dict[int, list[str]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(tensor), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]


def _without_model_state(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The trace without the model's tensors (units read their own model's): only the
    guard function, export's own subgraphs (the bodies of grad-mode and autocast regions,
    which take the model's tensors as inputs) and the constants the trace lifted out of
    the code stay."""
    kept = {str(node.target).split(".")[0] for node in graph_module.graph.nodes
            if is_subgraph(graph_module, node)}
    for name in list(graph_module._modules):
        if name != "_guards_fn" and name not in kept:
            del graph_module._modules[name]
    graph_module._parameters.clear()
    return graph_module


def _export(model: nn.Module, sample: Any, modes: tuple[bool, ...]
            ) -> tuple[torch.fx.GraphModule, CallSpec]:
    """``model``'s forward on ``sample``, as a graph module over the model's own tensors.

    Args:
        model: any module; its submodules' modes are set to ``modes`` for the trace and
            restored.
        sample: a batch as the model takes it (tensor, tuple of arguments, dict of
            keyword arguments).
        modes: each submodule's mode, in ``model.modules()`` order (dropout drawn or
            not, batch or running statistics).

    Raises:
        TraceError: export refused the model; the message names the module where it can.
    """
    _check_no_backward_hooks(model)
    args, kwargs = as_call(sample)
    oblivious = fx_config.patch(backed_size_oblivious=True)  # type: ignore[attr-defined]
    with _mode(model, modes), _no_cache(model), oblivious, _refusing_tensor_hooks(model), \
            _keywords_named(model, kwargs):
        shapes = _dynamic_shapes(model, args, kwargs)
        try:
            program = torch.export.export(model, args, kwargs, strict=False,
                                          dynamic_shapes=shapes)
        except TraceError:
            raise
        except Exception as error:  # export raises many kinds; all mean "cannot trace"
            if isinstance(error.__cause__, TraceError) or isinstance(error.__context__,
                                                                       TraceError):
                raise (error.__cause__ or error.__context__) from None  # type: ignore[misc]
            raise TraceError.from_export(error, model) from error
    return program.module(), CallSpec(args, kwargs)


def _dynamic_shapes(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``Dim.AUTO`` on every dimension of every tensor argument, by the forward's names,
    but those of size one: a size-one dimension is how inputs broadcast (a ``(rows, 1)``
    scale), and traced size-obliviously it could not."""
    def auto(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return {dim: Dim.AUTO for dim in range(leaf.dim()) if leaf.shape[dim] != 1}
        return None

    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as error:
        raise TraceError(
            f"the sample does not match {type(model).__name__}.forward's arguments: {error}"
        ) from None
    return {name: pytree.tree_map(auto, value) for name, value in bound.arguments.items()}


@contextlib.contextmanager
def _keywords_named(model: nn.Module, kwargs: dict[str, Any]) -> Iterator[None]:
    """For the trace, the keys of the sample that the forward's ``**kwargs`` collects
    (``model(x, return_dict=True)`` of ``forward(self, x, **kwargs)``) are keyword
    parameters of their own. Export takes dynamic shapes for a ``**kwargs`` parameter by
    the signature's name (``kwargs``) in one check and by the call's keys in the next, so
    no form passes both (torch 2.13): named, each key has its own. The forward runs as it
    is, called the same way; the model is left as it was."""
    forward = model.forward
    signature = inspect.signature(forward)
    parameters = list(signature.parameters.values())
    collected = [key for key in kwargs if key not in signature.parameters
                 or signature.parameters[key].kind is inspect.Parameter.POSITIONAL_ONLY]
    if not collected or not all(key.isidentifier() for key in collected) or not any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        yield
        return
    named = [p for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD] + [
        inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY) for key in collected]

    def explicit(*args: Any, **keywords: Any) -> Any:
        return forward(*args, **keywords)

    explicit.__signature__ = signature.replace(parameters=named)  # type: ignore[attr-defined]
    own = vars(model).get("forward")  # an instance forward of the user's, kept
    model.forward = explicit
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


@contextlib.contextmanager
def _mode(model: nn.Module, modes: tuple[bool, ...]) -> Iterator[None]:
    before = [(module, module.training) for module in model.modules()]
    for (module, _), training in zip(before, modes):
        module.training = training
    try:
        yield
    finally:
        for module, training in before:
            module.training = training


@contextlib.contextmanager
def _no_cache(model: nn.Module) -> Iterator[None]:
    """Hugging Face models return a key/value cache when ``config.use_cache`` is true; a
    training step never needs it, and export refuses its type: trace without it. Every
    config is turned off, not only the root's (T5's decoder holds a config of its own, a
    multimodal model nests its text model's), and each is restored afterwards, even when
    the trace fails."""
    turned_off: list[tuple[Any, Any]] = []
    try:
        for config in _configs(model):
            value = getattr(config, "use_cache", None)
            if value:
                config.use_cache = False
                turned_off.append((config, value))
        yield
    finally:
        for config, value in reversed(turned_off):
            config.use_cache = value


def _configs(model: nn.Module) -> list[Any]:
    """Every config the model's modules hold (``module.config``), and the configs nested in
    them (a config's attributes that are configs: ``text_config``, ``decoder``), each once."""
    found: dict[int, Any] = {}
    pending = [getattr(module, "config", None) for module in model.modules()]
    while pending:
        config = pending.pop()
        if id(config) in found or not _is_config(config):
            continue
        found[id(config)] = config
        pending.extend(value for value in vars(config).values() if _is_config(value))
    return list(found.values())


def _is_config(value: Any) -> bool:
    """A config object (a Hugging Face ``PretrainedConfig`` or alike): attributes of its
    own, and ``to_dict``."""
    return hasattr(value, "__dict__") and callable(getattr(value, "to_dict", None)) \
        and not isinstance(value, (nn.Module, torch.Tensor, type))
