"""The notebooks: committed without outputs, and each runs top to bottom, drawing its figures.

Each notebook is executed in a temporary copy by nbclient, on the ``python3``
kernel of this interpreter, with ``PIPESCHED_DOCS`` pointing its PNGs at a
temporary folder, so a test run never rewrites the committed ``docs/*.png``.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
DOCS = ROOT / "docs"
BUDGET_SECONDS = 90.0
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Per notebook: the tagged cells that must draw a figure, and the PNGs it writes to docs/.
EXPECTED = {
    "bubble_timelines.ipynb": {
        "figures": ["figure-timelines", "figure-bubble-vs-m", "figure-memory", "figure-measured"],
        "pngs": ["bubble_timelines.png", "bubble_vs_microbatches.png", "peak_memory.png",
                 "measured_vs_predicted.png", "overlap_timeline.png"],  # the last: a file only
    },
    "balancing.ipynb": {
        "figures": ["figure-balancing"],
        "pngs": ["balancing.png"],
    },
}


def _code_cells(notebook: Any) -> list[Any]:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def _tags(cell: Any) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def _images(cell: Any) -> int:
    return sum("image/png" in output.get("data", {}) for output in cell.outputs)


def test_the_notebooks_are_the_expected_ones() -> None:
    found = sorted(path.name for path in NOTEBOOKS.glob("*.ipynb"))
    assert found == sorted(EXPECTED), f"expected notebooks {sorted(EXPECTED)}, found {found}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_committed_without_outputs(name: str) -> None:
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    dirty = [
        index for index, cell in enumerate(_code_cells(notebook))
        if cell.outputs or cell.execution_count is not None
    ]
    assert not dirty, (
        f"{name}: code cells {dirty} carry outputs or execution counts; clear them "
        f"before committing (e.g. jupyter nbconvert --clear-output --inplace)"
    )


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_figure_cells_are_tagged(name: str) -> None:
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    tags = [tag for cell in _code_cells(notebook) for tag in _tags(cell)]
    missing = [tag for tag in EXPECTED[name]["figures"] if tag not in tags]
    assert not missing, f"{name}: no code cell tagged {missing}"


def test_the_kernel_is_this_python() -> None:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        pytest.fail("no 'python3' kernel: install the test extras (ipykernel) in this environment")
    program = spec.argv[0]
    # jupyter_client runs a bare "python" as sys.executable, the interpreter running the tests.
    bare = {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])}
    assert program in bare or Path(program).resolve() == Path(sys.executable).resolve(), (
        f"the python3 kernel runs {program!r}, not this interpreter {sys.executable!r}"
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_runs_and_draws_its_figures(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "notebooks"
    work.mkdir()
    copy = work / name
    shutil.copy(NOTEBOOKS / name, copy)
    docs = tmp_path / "docs"
    monkeypatch.setenv("PIPESCHED_DOCS", str(docs))  # the kernel inherits the environment
    notebook = nbformat.read(copy, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=240, kernel_name="python3",
        resources={"metadata": {"path": str(work)}},
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    seconds = time.perf_counter() - start
    nbformat.write(notebook, copy)  # kept in tmp_path for a look after a failure

    assert seconds < BUDGET_SECONDS, f"{name} took {seconds:.0f} s, over {BUDGET_SECONDS:.0f} s"
    cells = _code_cells(notebook)
    for tag in EXPECTED[name]["figures"]:
        tagged = [cell for cell in cells if tag in _tags(cell)]
        assert tagged and all(_images(cell) >= 1 for cell in tagged), (
            f"{name}: the cell tagged {tag!r} drew no figure"
        )
    total = sum(_images(cell) for cell in cells)
    assert total == len(EXPECTED[name]["figures"]), (
        f"{name}: expected {len(EXPECTED[name]['figures'])} figures, got {total}"
    )
    for png in EXPECTED[name]["pngs"]:
        path = docs / png
        assert path.is_file(), f"{name} did not write {png} to PIPESCHED_DOCS"
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, f"{png} is not a real PNG"


@pytest.mark.parametrize("png", sorted(png for spec in EXPECTED.values() for png in spec["pngs"]))
def test_the_rendered_figures_are_committed(png: str) -> None:
    path = DOCS / png
    assert path.is_file() and path.read_bytes().startswith(PNG_MAGIC), (
        f"docs/{png} is missing: run the notebook from notebooks/ to render it"
    )
