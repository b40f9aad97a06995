"""The shape of the code, counted with ``ast``: one kind of model around the runtime, small
modules, and one place that asks whether there is a process group."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

from units import Cut

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("schedules", "units", "split_backward", "partitioners", "pipeline")
# What a second kind of model looked like: the traced wrapper and its key translators.
TRACED_CASES = {"_traced", "TracedModel", "TracedCut", "to_model_state", "to_unit_state",
                "model_key", "unit_keys", "model_ties", "sequential_of", "as_sequential"}
FACADE = {"pipe.py", "pipe_views.py", "model_like.py"}


def _modules(*packages: str) -> list[Path]:
    return sorted(path for package in packages for path in (ROOT / package).rglob("*.py"))


def _names(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, (ast.ImportFrom, ast.Import)):
            found.update(alias.name.split(".")[-1] for alias in node.names)
        elif isinstance(node, ast.FunctionDef):
            found.add(node.name)
    return found


def test_no_traced_model_special_case_outside_units() -> None:
    found = {str(path.relative_to(ROOT)): sorted(_names(ast.parse(path.read_text())) & TRACED_CASES)
             for path in _modules("pipeline", "partitioners")}
    assert {path: names for path, names in found.items() if names} == {}


def test_nothing_reads_a_private_attribute_of_the_pipe() -> None:
    readers = []
    for path in _modules("pipeline", "partitioners"):
        if path.name in FACADE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "pipe" and node.attr.startswith("_"):
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno} pipe.{node.attr}")
    assert readers == []


def test_the_cut_is_typed() -> None:
    from pipeline.model_like import ModelLike

    assert typing.get_type_hints(ModelLike)["cut"] is Cut


def test_no_library_module_is_over_400_lines() -> None:
    long = {str(path.relative_to(ROOT)): count for path in _modules(*LIBRARY)
            if (count := len(path.read_text().splitlines())) > 400}
    assert long == {}


def test_group_is_none_is_asked_at_most_four_times() -> None:
    asked = [f"{path.relative_to(ROOT)}:{number}" for path in _modules("pipeline")
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if "group is None" in line]
    assert len(asked) <= 4, asked
