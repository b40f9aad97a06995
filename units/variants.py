"""Traces of other sizes: a micro-batch that breaks a guard of a model's trace gets its own.

A model's code may branch on a size (attention masks for a one-token sequence, a one-row
batch in a mixture of experts): export records the branch taken as a guard, and a graph
traced with 8 rows and 12 tokens refuses a micro-batch of one row or one token. As
``torch.compile`` recompiles on a failed guard, the first unit asks ``Retracer`` for a
trace of the model on that micro-batch; it is cut at the same places and each unit keeps
its program as a variant (``Unit.add_variant``). Later micro-batches of those sizes run it
at no cost; traces are bounded (``MAX_VARIANTS`` a mode), cached by ``export_model`` for
other models of the same make, and refused only when the new trace fails too.

A re-trace costs what the first trace of that mode cost (one ``torch.export``: seconds on
a CPU for a small Hugging Face model), once per new combination of traced sizes.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from units.boundaries import assign_units
from units.errors import TraceError
from units.programs import Program, cut_programs
from units.trace import export_model
from units.unit import Unit

MAX_VARIANTS = 4


def cut_units(graph_module: fx.GraphModule, starts: Sequence[str], default: bool
              ) -> tuple[list[Program], list[Any], list[str]]:
    """A traced graph cut where units begin: per unit its program, the output's leaves, and
    per unit its name (a prologue or epilogue that runs nothing is no unit)."""
    unit_of = assign_units(graph_module.graph, list(starts), epilogue=default)
    used = sorted(set(unit_of.values()))
    renumber = {old: new for new, old in enumerate(used)}
    unit_of = {node: renumber[unit] for node, unit in unit_of.items()}
    named = ["(prologue)", *starts, *(["(epilogue)"] if default else [])]
    programs, returned = cut_programs(graph_module, unit_of, len(used))
    return programs, returned, [named[old] for old in used]


class Retracer:
    """Traces the model on a micro-batch no unit variant runs, and gives every unit its
    program of that trace (``__call__`` -> whether it did)."""

    def __init__(self, model: nn.Module, units: Sequence[Unit], starts: Sequence[str],
                 default: bool, modes: dict[bool, tuple[bool, ...]],
                 rewrites: Sequence[Callable[[fx.GraphModule], Any]],
                 opaque: tuple[str, ...] = ()) -> None:
        self.model = model
        self.opaque = opaque  # experts modules traced as one call each (units.ep_dispatch)
        self.units = list(units)
        self.starts = list(starts)
        self.default = default
        self.modes = modes
        self.rewrites = rewrites  # the cut's passes, those added later too
        # A model's copy at one rank's sizes (its tensor-parallel shards'), and the passes a
        # whole graph of it takes before it is cut (the boundaries between split regions).
        self.localize: Callable[[nn.Module], nn.Module] | None = None
        self.passes: list[Callable[[fx.GraphModule], Any]] = []
        self.added = {True: 0, False: 0}
        self.refusal = ""  # why the last trace asked for could not be made
        self._lock = threading.Lock()

    def __call__(self, sample: Any, training: bool) -> bool:
        with self._lock:
            if self.added[training] >= MAX_VARIANTS:
                self.refusal = f"{MAX_VARIANTS} traces of other sizes are kept, no more"
                return False
            try:
                self._install(sample, training, Unit.add_variant)
            except TraceError as error:
                self.refusal = f"tracing it failed: {error}"
                return False
            self.added[training] += 1
            return True

    def retrace(self, sample: Any) -> None:
        """Trace the model again on ``sample`` in its present mode (its tensors as they are
        now: tensor-parallel shards) and make each unit run only that program; the other
        mode's programs are dropped, traced again on the first micro-batch run in it (a
        trace costs seconds, and most runs never leave one mode): on ``sample`` then, by
        whichever unit runs in it first, on any rank.

        Raises:
            TraceError: the new trace fails, or cuts into units that read other tensors.
        """
        with self._lock:
            self._install(sample, self.model.training, Unit.replace_variants)
            for unit in self.units:
                unit.drop_variants(not self.model.training)
                unit.fill = self._filler(sample)
            self.added = {True: 0, False: 0}

    def _filler(self, sample: Any) -> Callable[[bool], None]:
        """Trace ``sample`` in a mode whose programs were dropped, for every unit (once:
        the first unit of any rank to run in that mode asks, the others find them)."""
        def fill(training: bool) -> None:
            with self._lock:
                if not self.units[0].graphs_of(training):
                    self._install(sample, training, Unit.add_variant)
        return fill

    def _install(self, sample: Any, training: bool,
                 install: Callable[[Unit, bool, Program, Any], None]) -> None:
        graph_module = self._trace(sample, training)
        if self.passes:  # not on the trace export_model keeps for other models
            graph_module = own_copy(graph_module)
        for graph_pass in self.passes:
            graph_pass(graph_module)
        programs, returned, _ = cut_units(graph_module, self.starts, self.default)
        if len(programs) != len(self.units) or not all(
                _readable(unit, program, graph_module)
                for unit, program in zip(self.units, programs)):
            raise TraceError(f"its trace cuts into {len(programs)} units that read other "
                             f"tensors than the first trace's {len(self.units)}")
        outputs: Any = (returned, graph_module._out_spec)
        for unit, program in zip(self.units, programs):
            for rewrite in self.rewrites:
                rewrite(program.module)
            install(unit, training, program, outputs if unit is self.units[-1] else None)


    def _trace(self, sample: Any, training: bool) -> fx.GraphModule:
        """The model traced on ``sample``; where the runtime freed some of its tensors to
        ``meta`` (other ranks' stages), a copy of it all on ``meta`` is traced, and the
        graph's ``meta`` devices become the batch's."""
        if self.localize is None and not any(
                t.is_meta for t in [*self.model.parameters(), *self.model.buffers()]):
            return export_model(self.model, sample, self.modes[training], self.opaque)[0]
        leaves = [leaf for leaf in pytree.tree_leaves(sample) if isinstance(leaf, torch.Tensor)]
        device = leaves[0].device if leaves else torch.device("cpu")
        sample_on_meta = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), sample)
        model_on_meta = (self.localize or on_meta)(self.model)
        graph_module = export_model(model_on_meta, sample_on_meta, self.modes[training],
                                    self.opaque)[0]
        return _moved(graph_module, device)


def own_copy(graph_module: fx.GraphModule) -> fx.GraphModule:
    """``graph_module`` with a graph of its own (its attributes shared): a pass may change
    it without changing the trace ``export_model`` keeps."""
    graph = fx.Graph()
    graph._codegen = graph_module.graph._codegen
    graph.output(graph.graph_copy(graph_module.graph, {}))
    copied = object.__new__(type(graph_module))
    copied.__dict__ = dict(graph_module.__dict__)
    copied.graph = graph
    return copied


def on_meta(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose every tensor is an empty one on ``meta``, of its kind (a
    DTensor's of its local shard's size)."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        empty = torch.empty_like(local, device="meta")
        memo[id(tensor)] = (nn.Parameter(empty, requires_grad=tensor.requires_grad)
                            if isinstance(tensor, nn.Parameter) else empty)
    return copy.deepcopy(model, memo)


def _moved(graph_module: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """``graph_module`` (traced on ``meta``) with every ``meta`` device it names, in factory
    calls and metadata checks, as ``device``."""
    meta = torch.device("meta")

    def swap(value: Any) -> Any:
        return device if isinstance(value, torch.device) and value == meta else value

    modules = [graph_module, *(m for m in graph_module.modules() if isinstance(m, fx.GraphModule))]
    for module in dict.fromkeys(modules):
        for node in module.graph.nodes:
            node.args = pytree.tree_map(swap, node.args)
            node.kwargs = pytree.tree_map(swap, node.kwargs)
        module.recompile()
    return graph_module


def _readable(unit: Unit, program: Program, graph_module: fx.GraphModule) -> bool:
    """Whether ``unit`` holds everything ``program`` reads, lifting the trace's constants
    it does not hold yet (a constant of another value under a held name: no)."""
    for path in program.state:
        try:
            held = Unit.read_from(unit, path)
        except AttributeError:
            held = None
        lifted = getattr(graph_module, path, None) if "." not in path else None
        if lifted is not None and lifted.is_meta:  # traced on meta: only a held one is real
            lifted = None if held is not None else lifted
            if lifted is not None:
                return False
        if held is None and lifted is not None:
            unit.register_buffer(path, lifted, persistent=False)
            unit.lifted.add(path)
        elif held is None or (lifted is not None and path in unit.lifted
                              and not (held.shape == lifted.shape and bool((held == lifted).all()))):
            return False
    return True
