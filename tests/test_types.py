"""The packages type-check: ``mypy`` in strict mode (setup.cfg ``[mypy]``) finds nothing."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
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


def test_no_package_uses_a_module_mypy_skips() -> None:
    # A skipped module is Any to mypy: code using it would go unchecked without a word.
    skipped = _skipped_modules()
    assert "torch._dynamo" in skipped, "setup.cfg's skip list is gone: update this test"
    # "torch.jit.script" and "from torch import jit" alike
    spelled = [rf"\b{re.escape(name)}\b" for name in skipped] + [
        rf"from {re.escape(parent)} import .*\b{re.escape(child)}\b"
        for parent, _, child in (name.rpartition(".") for name in skipped) if parent
    ]
    pattern = re.compile("|".join(spelled))
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, (
        "these lines use modules that setup.cfg's [mypy-...] section skips; take the module "
        "off that list so that mypy checks the use:\n" + "\n".join(found)
    )
