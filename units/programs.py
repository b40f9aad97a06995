"""A traced graph cut into per-unit programs that hand each other what later units read.

Unit u's program takes the tensors it reads from the model (parameters, buffers, lifted
constants: read anew at every call, so that a module moved, sharded or freed by the
runtime is seen as it is now) and the values live at its entry, and returns the values
live at its exit: those produced so far that a later unit or the model's output reads.
A value is dropped after its last reader; a side value (the causal mask, rotary tables,
a long skip) travels with the activation only as far as it is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import fx

from units.errors import TraceError


@dataclass(frozen=True)
class Program:
    """One unit's code: ``module(*state, *entry) -> exit values`` (a tuple)."""

    module: fx.GraphModule
    state: tuple[str, ...]     # the model's attribute paths read, in argument order
    entry: tuple[str, ...]     # names of the values taken, for messages
    exit: tuple[str, ...]      # names of the values returned


def cut_programs(traced: fx.GraphModule, unit_of: dict[fx.Node, int], units: int
                 ) -> tuple[list[Program], list[Any]]:
    """Per unit, its program; and the model output's leaves as the last unit returns them
    (each a position in its exit tuple, or a constant).

    Raises:
        TraceError: the model's output reads a tensor of the model directly.
    """
    graph = traced.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    results = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    produced = {node: -1 for node in inputs}
    produced.update(unit_of)
    last_read: dict[fx.Node, int] = {}
    for node, unit in unit_of.items():
        for arg in node.all_input_nodes:
            last_read[arg] = max(last_read.get(arg, -1), unit)
    for leaf in results:
        if isinstance(leaf, fx.Node):
            if leaf.op == "get_attr":
                raise TraceError(f"the model returns its own tensor {leaf.target!r}: a unit "
                                 f"cannot hand a parameter on; return a computed value")
            last_read[leaf] = units  # read after the last unit
    ordered = [n for n in graph.nodes if n in produced]
    live_after = [
        [n for n in ordered if produced[n] <= u < last_read.get(n, -1)] for u in range(units)
    ]
    programs = []
    for u in range(units):
        entry = inputs if u == 0 else live_after[u - 1]
        exit_values = live_after[u] if u < units - 1 else _unique_nodes(results)
        programs.append(_program(traced, [n for n in graph.nodes if unit_of.get(n) == u],
                                 entry, exit_values))
    last_exit = _unique_nodes(results)
    returned = [last_exit.index(leaf) if isinstance(leaf, fx.Node) else _Constant(leaf)
                for leaf in results]
    return programs, returned


def is_subgraph(traced: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` reads a graph of export's own, not the model's state: the body of a
    higher-order op (a ``torch.no_grad()`` / ``torch.enable_grad()`` region runs as
    ``wrap_with_set_grad_enabled(mode, body, *inputs)``, a ``torch.autocast`` region as
    ``wrap_with_autocast(...)``), which takes the model's tensors as inputs."""
    if node.op != "get_attr":
        return False
    owner: Any = traced
    for part in str(node.target).split("."):
        owner = getattr(owner, part, None)
    return isinstance(owner, fx.GraphModule)


@dataclass(frozen=True)
class _Constant:
    value: Any


def constant_value(item: Any) -> tuple[bool, Any]:
    """(True, value) for an output leaf the graph returns as a constant."""
    return (True, item.value) if isinstance(item, _Constant) else (False, None)


def _unique_nodes(values: list[Any]) -> list[fx.Node]:
    found: list[fx.Node] = []
    for value in values:
        if isinstance(value, fx.Node) and value not in found:
            found.append(value)
    return found


def _program(traced: fx.GraphModule, body: list[fx.Node], entry: list[fx.Node],
             exit_values: list[fx.Node]) -> Program:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    state: list[str] = []
    reads = [arg for node in body for arg in node.all_input_nodes if arg.op == "get_attr"]
    for attribute in dict.fromkeys(reads):
        if is_subgraph(traced, attribute):  # export's own code, kept in the program
            env[attribute] = graph.get_attr(str(attribute.target))
        else:  # the model's tensor, read anew at every call
            env[attribute] = graph.placeholder(f"state_{len(state)}")
            state.append(str(attribute.target))
        env[attribute].meta = dict(attribute.meta)
    for value in entry:
        env[value] = graph.placeholder(value.name)
        env[value].meta = dict(value.meta)
    for node in body:
        env[node] = graph.node_copy(node, lambda arg: env[arg])
    graph.output(tuple(env[value] for value in exit_values))
    module = fx.GraphModule(traced, graph, class_name="UnitProgram")
    return Program(module, tuple(state), tuple(v.name for v in entry),
                   tuple(v.name for v in exit_values))
