"""Any nn.Module as a ``Cut`` of units: traced per mode, cut, under its own names.

``cut_model(model, sample)`` is how a model that is not an ``nn.Sequential`` becomes a
``Cut``: the balancer, the schedules, both runtimes and the mesh run its ``units`` (an
``nn.Sequential`` of ``Unit``) as they run a Sequential's layers, and each unit holds the
model's own modules at their paths, so its keys are the model's
(``"model.layers.2.mlp.up_proj.weight"``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from units.cut import Cut, TensorParallelPlan, UnitInfo
from units.boundaries import block_run, forward_order
from units.errors import TraceError
from units.programs import Program
from units.signature import ModelState, mode_differences, modes
from units.ep_dispatch import Exchange, local_experts, place_dispatch
from units.ep_plan import ExpertPlan, check_expert_split, resolve_expert_plan, shard_experts
from units.tp_graph import Boundaries, place_boundaries
from units.tp_local import check_splittable, localized, shard_parameters
from units.tp_plan import resolve_plan
from units.trace import export_model
from units.unit import Unit, attach
from units.variants import Retracer, cut_units, on_meta


class TracedCut(Cut):
    """A model traced and cut into units: each unit holds the model's own modules at their
    paths (so its keys are the model's), and the cut checks the model and batches against
    what its graphs were traced from."""

    def __init__(self, model: nn.Module, sequential: nn.Sequential, infos: list[UnitInfo],
                 traced_modes: dict[bool, tuple[bool, ...]]):
        super().__init__(model, sequential, infos, [""] * len(sequential))
        self._modes = traced_modes
        self._state = ModelState.of(model)  # what the graphs took from the model
        self.rewrites: list[Callable[[fx.GraphModule], Any]] = []
        self.retracer: Retracer | None = None  # set by cut_model
        self.sample: Any = None  # the batch it was traced with

    def check_split(self, plan: TensorParallelPlan, tp: int) -> None:
        """Raise ValueError, before anything is split or freed, for a plan by names the
        model cannot take over ``tp`` ranks (``units.tp_local.check_splittable``)."""
        if not callable(plan):
            check_splittable(self.model, resolve_plan(self.model, plan), tp)

    def parallelize(self, plan: TensorParallelPlan, tp_mesh: Any, indices: Sequence[int],
                    timeout: float | None = None) -> Boundaries | None:
        """Split the model over ``tp_mesh`` by ``plan`` (``"auto"`` or a dict of the model's
        module names to styles, ``units.tp_plan``): the planned modules of units
        ``indices`` get DTensor shards of their parameters, and every unit a program traced
        at one rank's sizes with Megatron's boundaries (``units.tp_graph``), whose
        all-reduces ``Boundaries`` counts (each waiting at most ``timeout`` seconds for the
        other ranks). A callable is called on each unit of
        ``indices`` (``fn(unit, tp_mesh)``) and nothing is traced again.

        Raises:
            ValueError: a plan the model cannot take (``check_splittable``).
            TraceError: the model traced at one rank's sizes fails (its code fixes a size
                the plan splits: a view with an explicit head count).
        """
        if callable(plan):
            super().parallelize(plan, tp_mesh, indices)
            return None
        assert self.retracer is not None
        tp = tp_mesh.size()
        styles = resolve_plan(self.model, plan)
        self.check_split(plan, tp)
        local = {name for index in indices for name in self.infos[index].modules}
        shard_parameters(self.model, styles, tp_mesh, local)
        boundaries = Boundaries(tp_mesh.get_group(), rank=tp_mesh.get_local_rank(),
                                timeout=timeout)
        earlier = self.retracer.localize
        self.retracer.localize = lambda model: localized(
            earlier(model) if earlier is not None else model, styles, tp)
        self.retracer.passes.append(lambda graph: place_boundaries(graph, styles, boundaries))
        try:
            self.retracer.retrace(self.sample)
        except TraceError as error:
            raise TraceError(
                f"{type(self.model).__name__} traced at one tensor-parallel rank's sizes "
                f"(tp={tp}) fails: {error}. Its code fixes a size the plan splits (a view "
                f"with an explicit head count, say), or a view merges a split dimension; "
                f"leave that module out of the plan") from error
        self._state = ModelState.of(self.model)
        return boundaries

    def check_expert_split(self, plan: ExpertPlan, ep: int) -> None:
        """Raise ValueError, before anything is sharded or freed, for an expert plan the
        model cannot take over ``ep`` ranks (``units.ep_plan.check_expert_split``)."""
        check_expert_split(self.model, resolve_expert_plan(self.model, plan), ep)

    def parallelize_experts(self, plan: ExpertPlan, ep_mesh: Any, indices: Sequence[int],
                            timeout: float | None = None) -> Exchange:
        """Spread the experts of the modules ``plan`` marks (``units.ep_plan``) over
        ``ep_mesh``: those of units ``indices`` get ``DTensor`` shards of their parameters
        (1/ep of the experts each), and every unit a program traced with each experts
        module one call that ``units.ep_dispatch.Exchange`` makes a token exchange (its
        all-to-alls each waiting at most ``timeout`` seconds for the other ranks).

        Raises:
            ValueError: a plan the model cannot take (``check_expert_split``).
        """
        assert self.retracer is not None
        names = resolve_expert_plan(self.model, plan)
        check_expert_split(self.model, names, ep_mesh.size())
        held = [parameter for index in indices for parameter in self.infos[index].parameters]
        local = {name for name in names if any(key.startswith(f"{name}.") for key in held)}
        shard_experts(self.model, names, ep_mesh, local)
        self._hold_anew(indices, local)
        exchange = Exchange(ep_mesh.get_group(), self.model, timeout)
        missing = [name for name in names if name not in self.retracer.opaque]
        if missing:
            raise ValueError(f"expert parallelism needs the experts modules traced as one call "
                             f"each: cut the model with cut_model(..., experts={names}) (Pipe "
                             f"does, given a mesh with an 'ep' dimension); {missing} were not")
        self.retracer.localize = self.retracer.localize or on_meta  # its shards' sizes
        self.retracer.passes.append(lambda graph: place_dispatch(graph, exchange))
        self.retracer.retrace(self.sample)
        self._state = ModelState.of(self.model)
        return exchange

    def _hold_anew(self, indices: Sequence[int], modules: set[str]) -> None:
        """Make units ``indices`` hold the parameters ``modules`` hold now, where they hold
        those tensors alone (their module has children: an experts module's ``act_fn``)."""
        for index in indices:
            unit = self.units[index]
            for key in self.infos[index].parameters:
                owner, _, name = key.rpartition(".")
                if owner not in modules:
                    continue
                now = self.model.get_submodule(owner).get_parameter(name)
                if Unit.read_from(unit, key) is not now:
                    attach(unit, owner, tensor=(name, now, True))

    @property
    def takes_batch_as_written(self) -> bool:
        return True

    def check_batch(self, batch: Any) -> None:
        """Raise ValueError now, before a step begins, for a batch the first unit would refuse
        (other arguments or keys, another value of a non-tensor argument)."""
        self._first.check(batch)

    def prepare(self, microbatches: Sequence[Any]) -> None:
        """Trace, before a step, the sizes of micro-batches the traces so far cannot run
        (``units.variants``), so that every unit of this process has their variants."""
        for microbatch in microbatches:
            self._first.prepare(microbatch, self.model.training)

    def check_model(self) -> None:
        """Raise ValueError now, before a step begins, if the model is no longer the one its
        graphs were traced from: an attribute, a module, an instance forward, a hook or a
        submodule's mode changed since (the graphs would run the model as it was).

        What it costs a step: a walk over the model's modules and a comparison of their
        attributes (``benchmarks/bench_trace_check.py``)."""
        changes = self._state.differences(ModelState.of(self.model), same_object=True)
        changes += mode_differences(self.model, self._modes[self.model.training])
        if changes:
            shown = "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more"
                                               if len(changes) > 4 else "")
            raise ValueError(
                f"the model changed since the Pipe traced it ({shown}): its graphs run the "
                f"model as it was traced. Build a new Pipe for the model as it is now (it "
                f"traces it again), or undo the change"
            )

    def check_options(self, deferred_batch_norm: bool) -> None:
        """Refuse ``deferred_batch_norm=True`` for a model holding BatchNorm layers: a traced
        graph calls ``batch_norm`` itself, never the layer's forward, where the deferred
        statistics are gathered (it would update them per micro-batch, silently).

        Raises:
            ValueError: such a model and option.
        """
        norms = [name for name, module in self.model.named_modules()
                 if isinstance(module, nn.modules.batchnorm._BatchNorm)]
        if deferred_batch_norm and norms:
            raise ValueError(
                f"deferred_batch_norm=True updates BatchNorm statistics from the layers' own "
                f"forward, which a traced model does not call ({len(norms)} BatchNorm layers, "
                f"e.g. {norms[0]!r}); leave it off (each micro-batch counts once, as in the "
                f"plain model run micro-batch by micro-batch), or give the Pipe an "
                f"nn.Sequential of your blocks"
            )

    def rewrite(self, rewrite: Callable[[fx.GraphModule], Any]) -> None:
        """Apply ``rewrite`` to every program of every unit, and to those later traces add."""
        if rewrite in self.rewrites:
            return
        self.rewrites.append(rewrite)
        for unit in self.units:
            assert isinstance(unit, Unit)
            for graph in unit.graphs:
                rewrite(graph)

    @property
    def _first(self) -> Unit:
        first = self.units[0]
        assert isinstance(first, Unit)
        return first


def cut_model(model: nn.Module, sample: Any, units: Sequence[str] | None = None,
              experts: Sequence[str] = ()) -> TracedCut:
    """Trace ``model`` with ``sample`` (training and evaluation modes) and cut it.

    Args:
        model: any module whose forward torch.export can capture.
        sample: a batch as the model takes it: a tensor, a tuple of positional
            arguments, or a dict of keyword arguments (``model(**sample)``).
        units: module names (as in ``model.named_modules()``) where units begin, in the
            order the forward runs them; None: the prologue, each block of the model's
            main run of same-class blocks, and the epilogue.
        experts: names of experts modules (``units.ep_plan``), each traced as one call
            that runs the module as it is written (a loop over the experts picked, which a
            graph cannot follow, runs too); ``parallelize_experts`` makes them token
            exchanges.

    Raises:
        TraceError: the model cannot be traced, or ``units`` names no module it runs.
        ValueError: no sample.
    """
    if sample is None:
        raise ValueError(
            f"Pipe needs sample=... to cut a {type(model).__name__} (a model that is not an "
            f"nn.Sequential is traced once with a batch as it takes it: a tensor, a tuple of "
            f"arguments or a dict of keyword arguments)"
        )
    on_meta = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()]
               if tensor.is_meta]
    if on_meta:
        raise TraceError(
            f"a model is traced by running its forward, so its tensors must be real: "
            f"{len(on_meta)} are on the meta device (e.g. {on_meta[0]!r}); materialise it "
            f"(to_empty and initialise) before Pipe, or give the Pipe an nn.Sequential, "
            f"whose layers each rank materialises with init_fn"
        )
    starts = list(units) if units is not None else block_run(model)
    if not starts:
        raise TraceError(
            f"{type(model).__name__} has no run of same-class blocks (a ModuleList or "
            f"Sequential of one class) to cut at: pass units=[module names] where units begin"
        )
    traced: dict[bool, fx.GraphModule] = {}
    cut: dict[bool, tuple[list[Program], list[Any]]] = {}
    call = None
    mixes = _traced_modes(model)
    for training in (True, False):
        graph_module, call = export_model(model, sample, mixes[training], tuple(experts))
        if units is None and training:  # the order the forward runs them, not their names'
            starts = forward_order(graph_module.graph, starts) or starts
        traced[training] = graph_module
        programs, returned, names = cut_units(graph_module, starts, units is None)
        cut[training] = (programs, returned)
        placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != call.leaves:
            raise TraceError(f"the traced graph takes {len(placeholders)} inputs, the sample "
                             f"has {call.leaves} leaves")
    counts = {len(cut[mode][0]) for mode in cut}
    if len(counts) != 1:
        raise TraceError("the training and evaluation forwards cut into different numbers of "
                         "units: pass units=[...]")
    assembled = _assemble(model, traced, cut, call, names, mixes)
    units_run = [unit for unit in assembled.units if isinstance(unit, Unit)]
    # the first unit traces the sizes no variant runs, under the cut's rewrites
    assembled.retracer = Retracer(model, units_run, starts, units is None, mixes,
                                  assembled.rewrites, tuple(experts))
    if experts:
        assembled.rewrite(local_experts(model))
    assembled.sample = sample
    units_run[0].grow = assembled.retracer
    return assembled


def _traced_modes(model: nn.Module) -> dict[bool, tuple[bool, ...]]:
    """The submodules' modes each graph is traced in: in the root's present mode, as they
    are now (a BatchNorm frozen in a training model stays frozen); in the other, all alike."""
    now = modes(model)
    return {training: now if model.training == training else (training,) * len(now)
            for training in (True, False)}


def _assemble(model: nn.Module, traced: dict[bool, fx.GraphModule],
              cut: dict[bool, tuple[list[Program], list[Any]]], call: Any,
              names: list[str], mixes: dict[bool, tuple[bool, ...]]) -> TracedCut:
    programs = {mode: cut[mode][0] for mode in cut}
    count = len(programs[True])
    mode = _RootMode(model)
    sequential = nn.Sequential()
    outputs: dict[bool, tuple[Sequence[Any], Any]] = {
        m: (cut[m][1], traced[m]._out_spec) for m in cut}
    units = []
    for index in range(count):
        per_mode = {m: programs[m][index] for m in programs}
        units.append(Unit(index, names[index], per_mode, mode, call if index == 0 else None,
                          outputs if index == count - 1 else None))
        sequential.append(units[-1])
    infos = _hold_state(model, units, programs, traced)
    return TracedCut(model, sequential, infos, mixes)


class _RootMode:
    """The root model's mode, read at every call (``model.train()`` / ``.eval()``)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self) -> bool:
        return self.model.training


def _hold_state(model: nn.Module, sequential: list[Unit],
                programs: dict[bool, list[Program]], traced: dict[bool, fx.GraphModule]
                ) -> list[UnitInfo]:
    """Give each unit the model's modules (or tensors) its programs read; state nothing
    reads goes to the last unit, so that every key of the model has a holder."""
    owners = _owners(model)
    persistent = set(model.state_dict(keep_vars=True))
    aliases: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        aliases.setdefault(id(tensor), []).append(name)
    held: set[str] = set()
    infos = []
    for index, unit in enumerate(sequential):
        paths = sorted({path for mode in programs for path in programs[mode][index].state})
        attached: list[str] = []
        for path in paths:
            lifted = _lifted(path, model, traced)
            if lifted is not None:
                unit.register_buffer(path, lifted, persistent=False)
                unit.lifted.add(path)
                continue
            # every name of a tied tensor, so that no holder of it is left to another unit
            for alias in aliases.get(id(Unit.read_from(model, path)), [path]):
                _attach(unit, alias, owners, persistent, attached)
        unit_keys = set(unit.state_dict(keep_vars=True))
        held.update(unit_keys)
        infos.append(UnitInfo(index, unit.name, tuple(attached),
                              tuple(name for name, _ in unit.named_parameters())))
    leftovers = [key for key in persistent if key not in held]
    for key in leftovers:
        _attach(sequential[-1], key, owners, persistent, [])
    return infos


def _lifted(path: str, model: nn.Module, traced: dict[bool, fx.GraphModule]
            ) -> torch.Tensor | None:
    """A constant tensor the trace lifted out of the code (not the model's own state)."""
    if "." in path or hasattr(model, path):
        return None
    for graph_module in traced.values():
        value = getattr(graph_module, path, None)
        if isinstance(value, torch.Tensor):
            return value
    return None


def _owners(model: nn.Module) -> dict[str, nn.Module]:
    return dict(model.named_modules(remove_duplicate=False))


def _attach(unit: Unit, path: str, owners: dict[str, nn.Module], persistent: set[str],
            attached: list[str]) -> None:
    """Attach what holds the model's tensor at ``path``: its module when that module has
    no children (a Linear, a norm: kept whole, so its type stays), else the tensor alone;
    a constant the trace lifted becomes a buffer of the unit."""
    owner_path, _, name = path.rpartition(".")
    owner = owners.get(owner_path)
    if owner is None or not hasattr(owner, name):
        raise TraceError(f"the traced graph reads {path!r}, which the model does not hold")
    if owner_path and not list(owner.children()):
        if owner_path not in attached:
            unit.attach(owner_path, module=owner)
            attached.append(owner_path)
        return
    value = getattr(owner, name)
    if not isinstance(value, torch.Tensor):
        raise TraceError(f"the traced graph reads {path!r}, a {type(value).__name__}")
    unit.attach(owner_path, tensor=(name, value, path in persistent))
