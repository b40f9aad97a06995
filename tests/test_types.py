"""The packages type-check: ``mypy`` in strict mode (setup.cfg ``[mypy]``) finds nothing."""

from __future__ import annotations

import ast
import configparser
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["schedules", "units", "split_backward", "partitioners", "pipeline"]


def test_mypy_finds_no_errors() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy", *PACKAGES],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, f"mypy failed:\n{done.stdout}{done.stderr}"


def _skipped_modules() -> list[str]:
    """The modules setup.cfg tells mypy not to follow (``follow_imports = skip``)."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    skipped = []
    for section in config.sections():
        if section.startswith("mypy-") and config[section].get("follow_imports") == "skip":
            skipped += [pattern.strip().removesuffix(".*")
                        for pattern in section.removeprefix("mypy-").split(",")]
    return skipped


def _used_names(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Each module name the code imports, and each dotted name it reads (``torch.jit.script``),
    with its line; strings and comments are not code."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Attribute):
            parts, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name):
                yield node.lineno, ".".join([value.id, *reversed(parts)])


def test_no_package_uses_a_module_mypy_skips() -> None:
    # A skipped module is Any to mypy: code using it would go unchecked without a word.
    skipped = _skipped_modules()
    assert "torch._dynamo" in skipped, "setup.cfg's skip list is gone: update this test"
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, name in _used_names(ast.parse(path.read_text()))
        if any(name == module or name.startswith(module + ".") for module in skipped)
    ]
    assert not found, (
        "these lines use modules that setup.cfg's [mypy-...] section skips; take the module "
        "off that list so that mypy checks the use:\n" + "\n".join(found)
    )
