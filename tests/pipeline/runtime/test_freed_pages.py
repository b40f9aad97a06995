"""A CPU Pipe leaves malloc alone; ``pipeline.keep_freed_pages()`` is the opt-in that
keeps freed memory for the next allocations, for the rest of the process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import keep_freed_pages

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "pipeline" / "helpers" / "freed_pages_workers.py"
GIB = 1 << 30


def _fresh_process(**environment: str) -> dict[str, dict[str, int] | bool]:
    done = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True,
                          env={**os.environ, **environment, "PYTHONPATH": os.pathsep.join(
                              [str(ROOT), os.environ.get("PYTHONPATH", "")])}, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, dict[str, int] | bool] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_cpu_pipe_leaves_malloc_alone_and_the_opt_in_keeps_freed_pages() -> None:
    result = _fresh_process()
    plain, kept = result["plain"], result["kept"]
    assert isinstance(plain, dict) and isinstance(kept, dict)
    assert result["asked_by_the_pipe"] is False
    assert plain["alive"] - plain["before"] > 0.9 * GIB, result  # the round touched its pages
    # glibc's defaults: 4 MiB blocks are mapped apart, and unmapped when freed.
    assert plain["after"] - plain["before"] < 0.05 * GIB, result
    # Opted in: the same round's memory stays with the process for its next allocations.
    assert result["applied"] is True
    assert kept["after"] - plain["after"] > 0.9 * GIB, result


def test_the_users_own_malloc_setting_is_left_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    # Answered before any mallopt call, so this process is left as it was.
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert keep_freed_pages.__wrapped__() is False
