"""The import graph: no cycle between modules, and packages point one way.

``schedules``, ``units``, ``split_backward`` <- ``partitioners`` <- ``pipeline``: the three
leaves import none of the others (units, the tracer, and split_backward, I and W, import
only torch), partitioners never imports pipeline. Inside ``pipeline`` the rooms point one
way too, from the façade (``Pipe``) down through what is decided once at build
(``setup``), what predicts a step (``predict``), what runs every step (``runtime``),
to the process group, the transports, one chunk's compute, the payloads and the
errors: the runtime never imports prediction, and nothing below the façade
imports it. Inside ``partitioners`` the rooms go by phase: the command (``cli``) over the
whole plan (``plan``) over the cut (``cut``) over what is measured (``measure``), with the
package's error at the bottom. Every ``from``-import of these
packages counts, lazy ones inside functions and ``TYPE_CHECKING`` ones included: a
cycle broken by a late import is still a cycle to read.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
LEAVES = ("schedules", "units", "split_backward")
PACKAGES = (*LEAVES, "partitioners", "pipeline")
# The leaves share the lowest rank: one pointing at another is the leaf test's to refuse.
RANK = {name: max(0, rank - len(LEAVES) + 1) for rank, name in enumerate(PACKAGES)}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> nx.DiGraph:
    """Module -> the modules of the three packages it imports from."""
    graph = nx.DiGraph()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            module = _module(path)
            graph.add_node(module)
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                        and node.module.split(".")[0] in PACKAGES:
                    graph.add_edge(module, node.module)
    return graph


def test_no_module_imports_itself_round_a_cycle() -> None:
    graph = import_graph()
    # A package's __init__ re-exports its modules; a module importing from the package
    # name itself is an import of those, not a cycle of modules.
    modules = graph.subgraph(node for node in graph if node not in PACKAGES)
    assert list(nx.simple_cycles(modules)) == []


def test_leaves_import_no_other_package() -> None:
    wrong = [(source, target) for source, target in import_graph().edges
             if source.split(".")[0] in LEAVES and target.split(".")[0] != source.split(".")[0]]
    assert wrong == []


def test_split_backward_imports_only_torch() -> None:
    allowed = {"torch", "split_backward", "__future__", *sys.stdlib_module_names}
    found = set()
    for path in (ROOT / "split_backward").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    assert "torch" in found and sorted(found - allowed) == []


def test_packages_point_one_way() -> None:
    wrong = [(source, target) for source, target in import_graph().edges
             if RANK[target.split(".")[0]] > RANK[source.split(".")[0]]]
    assert wrong == []


def _room(module: str, rooms: tuple[str, ...]) -> int:
    """How high ``module`` sits in its package: ``rooms`` go from the top down, and the
    package's hall (its top-level modules, the façade) is above them all; the rooms of
    ``ABOVE_THE_HALL`` use the façade and sit above it, and the package's ``__init__`` (its
    public names) above everything."""
    parts = module.split(".")
    if len(parts) == 1:
        return len(rooms) + len(ABOVE_THE_HALL) + 1
    if parts[1] in ABOVE_THE_HALL:
        return len(rooms) + len(ABOVE_THE_HALL) - ABOVE_THE_HALL.index(parts[1])
    if parts[1] in rooms:
        return len(rooms) - 1 - rooms.index(parts[1])
    return len(rooms)


def _pointing_up(package: str, rooms: tuple[str, ...]) -> list[tuple[str, str]]:
    """The imports inside ``package`` from a lower room to a higher one (or to the hall)."""
    return [(source, target) for source, target in import_graph().edges
            if source.split(".")[0] == package and target.startswith(f"{package}.")
            and _room(target, rooms) > _room(source, rooms)]


def _in_the_hall(package: str, rooms: tuple[str, ...]) -> list[str]:
    return sorted(module for module in import_graph()
                  if module.startswith(f"{package}.") and _room(module, rooms) == len(rooms))


# pipe.py, pipe_views.py, model_like.py: the hall (façade). ``saving`` (checkpoints, the
# rank-0 state dict) takes a Pipe and sits above it: nothing of the Pipe imports it.
# ``launching`` (local gloo ranks for tests, examples and benchmarks) sits above every room
# and nothing in the library imports it.
ABOVE_THE_HALL = ("saving",)
ROOMS = ("launching", "setup", "predict", "runtime", "group", "transports", "compute",
         "payloads", "errors")


def test_pipeline_rooms_point_down() -> None:
    assert _pointing_up("pipeline", ROOMS) == []


def test_nothing_in_the_library_launches_ranks() -> None:
    importers = sorted(source for source, target in import_graph().edges
                       if target.startswith("pipeline.launching")
                       and not source.startswith("pipeline.launching"))
    assert importers == []


def test_every_pipeline_module_has_a_room() -> None:
    assert _in_the_hall("pipeline", ROOMS) == [
        "pipeline.model_like", "pipeline.pipe", "pipeline.pipe_views"]


def test_nothing_the_pipe_runs_imports_saving() -> None:
    importers = sorted(source for source, target in import_graph().edges
                       if target.startswith("pipeline.saving") and source != "pipeline"
                       and not source.startswith("pipeline.saving"))
    assert importers == []


# partitioners/__init__.py and __main__.py, the public names: the hall.
PARTITIONER_ROOMS = ("cli", "plan", "cut", "measure", "errors")


def test_partitioners_rooms_point_down() -> None:
    assert _pointing_up("partitioners", PARTITIONER_ROOMS) == []


def test_every_partitioners_module_has_a_room() -> None:
    assert _in_the_hall("partitioners", PARTITIONER_ROOMS) == ["partitioners.__main__"]


def test_partitioners_keeps_at_most_eight_files_in_its_hall() -> None:
    hall = sorted(path.name for path in (ROOT / "partitioners").iterdir() if path.is_file())
    assert len(hall) <= 8, hall
