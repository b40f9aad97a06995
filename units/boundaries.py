"""Where units begin: every block of the model's most frequent block class, or module names given.

A node of the traced graph belongs to the unit whose first module ran last before it:
each block's ops are its own unit, what runs before the first block is the prologue
(embeddings, rotary tables, the mask), what runs between two blocks belongs to the
block before, and what runs after the last block is the epilogue (final norm, head).
A node is then moved later if an input of it comes from a later unit, so that values
only ever flow forward.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import fx, nn

from units.errors import TraceError


def block_run(model: nn.Module) -> list[str]:
    """The names of the model's blocks: every block of its most frequent block class, across
    containers (a ResNet's BasicBlocks in layer1..layer4), as ``named_modules`` lists them.

    A block is a child of a ``ModuleList`` or ``Sequential`` whose children are all of one
    class (a T5 encoder's single block counts beside its decoder's), not inside another
    block (a mixture's experts are part of their layer), unless that block is itself a
    plain container (blocks grouped in a Sequential of Sequentials are counted across the
    groups). The class with the most blocks wins, ties going to the one with more
    parameters; a class without parameters (a run of dropouts) loses to any with. Empty
    when no class has two blocks.
    """
    blocks = _blocks(model)
    kinds: dict[type, list[str]] = {}
    for name, module in blocks.items():
        kinds.setdefault(type(module), []).append(name)

    def rank(kind: type) -> tuple[bool, int, int]:
        size = sum(_size(blocks[name]) for name in kinds[kind])
        return size > 0, len(kinds[kind]), size

    chosen = max(kinds, key=rank, default=None)
    if chosen is None or len(kinds[chosen]) < 2:
        return []
    return _outermost(kinds[chosen])


def _blocks(model: nn.Module) -> dict[str, nn.Module]:
    """Children of the runs of same-class modules, by name, that no block other than a
    plain container holds."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if not _is_run(module) or _held_by_a_block(name, found):
            continue
        for child_name, child in module.named_children():
            found[f"{name}.{child_name}" if name else child_name] = child
    return found


def _is_run(module: nn.Module) -> bool:
    children = list(module.children())
    return (isinstance(module, (nn.ModuleList, nn.Sequential))
            and len({type(child) for child in children}) == 1)


def _held_by_a_block(name: str, blocks: dict[str, nn.Module]) -> bool:
    return any(_within(name, block) and not isinstance(module, (nn.ModuleList, nn.Sequential))
               for block, module in blocks.items())


def _outermost(names: list[str]) -> list[str]:
    """``names`` less those inside another of them."""
    return [name for name in names
            if not any(other != name and _within(name, other) for other in names)]


def _size(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def forward_order(graph: fx.Graph, starts: Sequence[str]) -> list[str]:
    """``starts`` that the traced forward runs, in the order it first runs them (blocks of
    a decoder defined before its encoder, run after it)."""
    first_at: dict[str, int] = {}
    computing = [n for n in graph.nodes if is_computing(n)]
    for position, node in enumerate(computing):
        for path in _module_paths(node):
            for start in starts:
                if _within(path, start):
                    first_at.setdefault(start, position)
    return sorted(first_at, key=lambda start: first_at[start])


def _module_paths(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for path, _ in stack.values():
        # export names a path from the root: "L['self'].model.layers[0]" or "model.layers.0"
        paths.append(_plain(path))
    return paths


def _plain(path: str) -> str:
    text = path.removeprefix("L['self']").removeprefix(".")
    text = text.replace("[", ".").replace("]", "").replace("'", "")
    return text.strip(".")


def _within(path: str, start: str) -> bool:
    return path == start or path.startswith(start + ".")


def assign_units(graph: fx.Graph, starts: Sequence[str], epilogue: bool) -> dict[fx.Node, int]:
    """Each computing node's unit: 0 is the prologue, unit k begins at ``starts[k - 1]``.

    Args:
        graph: the traced graph.
        starts: module names, each beginning a unit, in the order they run.
        epilogue: the default cut: what runs after the last start's module is a unit of
            its own (with names given, the last unit runs to the end).

    Raises:
        TraceError: a start that no op of the graph runs in, or starts out of order.
    """
    computing = [n for n in graph.nodes if n.op in ("call_function", "call_module", "call_method")]
    first_at: dict[str, int] = {}
    last_at: dict[str, int] = {}
    for position, node in enumerate(computing):
        for path in _module_paths(node):
            for start in starts:
                if _within(path, start):
                    first_at.setdefault(start, position)
                    last_at[start] = position
    missing = [s for s in starts if s not in first_at]
    if missing:
        raise TraceError(
            f"no operation of the traced forward runs in {missing}: expected names of "
            f"modules the forward calls (as in model.named_modules()), e.g. "
            f"{_some_names(graph)}"
        )
    order = sorted(starts, key=lambda s: first_at[s])
    if list(order) != list(starts):
        raise TraceError(f"units must be given in the order the forward runs them: {order}, "
                         f"got {list(starts)}")
    beginnings = [first_at[s] for s in starts]
    end = last_at[starts[-1]] if epilogue else None
    unit: dict[fx.Node, int] = {}
    for position, node in enumerate(computing):
        index = sum(1 for b in beginnings if b <= position)
        if end is not None and position > end and not _inside_any(node, starts):
            index = len(starts) + 1
        inputs = [unit[arg] for arg in node.all_input_nodes if arg in unit]
        unit[node] = max([index, *inputs])
    return unit


def _inside_any(node: fx.Node, starts: Sequence[str]) -> bool:
    return any(_within(path, s) for path in _module_paths(node) for s in starts)


def _some_names(graph: fx.Graph) -> list[str]:
    names: list[str] = []
    for node in graph.nodes:
        for path in _module_paths(node):
            if path and path not in names:
                names.append(path)
    return names[:6]


def is_computing(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_module", "call_method")

