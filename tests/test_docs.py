"""docs/api.md stays true: its examples run, it names every public name, its CLI flags exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", API.read_text(encoding="utf-8"), re.S)


def test_the_python_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    blocks = [block for block in _blocks("python") if "torchrun" not in block]
    assert len(blocks) >= 10, f"expected the API examples, found {len(blocks)} python blocks"
    namespace: dict[str, Any] = {"__name__": "api_md"}
    for index, block in enumerate(blocks):
        try:
            exec(compile(block, f"{API.name} block {index}", "exec"), namespace)
        except Exception as error:  # noqa: BLE001 - re-raised with the block shown
            raise AssertionError(f"docs/api.md python block {index} failed:\n{block}") from error


def test_every_public_name_is_documented() -> None:
    import partitioners
    import pipeline
    import schedules
    import units

    text = API.read_text(encoding="utf-8")
    missing = [
        f"{package.__name__}.{name}"
        for package in (schedules, units, partitioners, pipeline)
        for name in package.__all__
        if f"`{name}" not in text
    ]
    assert not missing, f"docs/api.md does not mention: {', '.join(missing)}"


def test_the_cli_flags_shown_exist() -> None:
    shown = {flag for block in _blocks("bash") for flag in re.findall(r"--[a-z][a-z-]+", block)}
    assert shown, "expected a pipe-balance example in docs/api.md"
    help_text = subprocess.run(
        [sys.executable, "-m", "partitioners", "--help"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout
    unknown = sorted(flag for flag in shown if flag not in help_text)
    assert not unknown, f"docs/api.md shows pipe-balance flags it does not have: {unknown}"


def test_the_readme_quickstart_runs_and_its_images_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    first_block = re.findall(r"```python\n(.*?)```", readme, re.S)[0]
    namespace: dict[str, Any] = {}
    exec(compile(first_block, "README.md", "exec"), namespace)
    assert 0.0 <= namespace["pipe"].timeline.bubble_fraction < 1.0
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", readme):
        assert (ROOT / image).is_file(), image


def test_the_architecture_names_every_module() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = []
    for package in ("schedules", "units", "split_backward", "partitioners", "pipeline"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            inside = path.relative_to(ROOT / package).as_posix()
            if "/" in inside:  # named in its room's lines of the map
                named = re.search(rf"^ ?{re.escape(path.parent.name)}/(?:[^\n]|\n(?=\s))*?"
                                  rf"{re.escape(path.name)}", page, re.M)
            else:  # by its path, or by its bare name
                named = re.search(rf"{package}/{re.escape(path.name)}|(?<![\w/]){re.escape(path.name)}",
                                  page)
            if named is None:
                missing.append(path.relative_to(ROOT).as_posix())
    assert missing == [], f"docs/architecture.md does not name: {missing}"
