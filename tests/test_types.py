"""The packages type-check: ``mypy`` in strict mode (setup.cfg ``[mypy]``) finds nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_finds_no_errors() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "schedules", "units", "split_backward", "partitioners",
         "pipeline"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, f"mypy failed:\n{done.stdout}{done.stderr}"
