"""One public face: ``pipeline.__all__`` is the one list of names, docs/api.md's pipeline
section names exactly those, and every checkpoint name README and docs mention imports from
``pipeline``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pipeline

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Saving and loading state: pipeline's functions and its error, as prose names them.
CHECKPOINT_NAME = re.compile(r"\b((?:save|load)_(?:[a-z]+_)*checkpoint|load_into_model|"
                             r"CheckpointError)\b")


def _index_names() -> list[str]:
    """The names the contents list at the top of docs/api.md gives for ``pipeline``: its
    bullet, up to the prose that follows the names (``; what is``)."""
    text = API.read_text(encoding="utf-8")
    bullet = re.search(r"^- \[pipeline\]\(#pipeline\):(.*?)(?=^- |^$)", text, re.S | re.M)
    assert bullet is not None, "docs/api.md's contents list has no pipeline bullet"
    names = bullet.group(1).split("; what is")[0]
    return re.findall(r"`([A-Za-z_][A-Za-z_0-9]*)`", names)


def _pipeline_section() -> str:
    text = API.read_text(encoding="utf-8")
    start = text.index("\n## pipeline\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_all_is_one_plain_list() -> None:
    tree = ast.parse((ROOT / "pipeline" / "__init__.py").read_text(encoding="utf-8"))
    lists = [node for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)]
    assert len(lists) == 1
    # No second way in: no module __getattr__, nothing imported for type checkers only.
    assert not [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    assert not [node for node in tree.body if isinstance(node, ast.If)]
    assert len(pipeline.__all__) == len(set(pipeline.__all__))
    assert all(name in vars(pipeline) for name in pipeline.__all__)


def test_the_docs_name_exactly_the_public_names() -> None:
    listed = _index_names()
    assert sorted(listed) == sorted(pipeline.__all__)
    section = _pipeline_section()
    undocumented = [name for name in pipeline.__all__ if f"`{name}" not in section]
    assert undocumented == [], f"docs/api.md's pipeline section does not describe {undocumented}"


def test_every_documented_import_from_pipeline_is_public() -> None:
    imported = set()
    for document in DOCUMENTS:
        for line in re.findall(r"from pipeline import ([^\n]+)", document.read_text("utf-8")):
            imported.update(name.strip(" ()\\") for name in line.split("#")[0].split(","))
    imported.discard("")
    assert imported and sorted(imported - set(pipeline.__all__)) == []


def test_every_checkpoint_name_in_the_docs_imports_from_pipeline() -> None:
    mentioned = {name for document in DOCUMENTS
                 for name in CHECKPOINT_NAME.findall(document.read_text(encoding="utf-8"))}
    assert {"save_checkpoint", "load_checkpoint", "load_into_model", "save_model_checkpoint",
            "CheckpointError"} <= mentioned
    missing = sorted(name for name in mentioned if name not in pipeline.__all__)
    assert missing == [], f"mentioned in README/docs but not importable from pipeline: {missing}"
    namespace: dict[str, object] = {}
    exec(f"from pipeline import {', '.join(sorted(mentioned))}", namespace)  # noqa: S102
    assert all(callable(namespace[name]) for name in mentioned)
