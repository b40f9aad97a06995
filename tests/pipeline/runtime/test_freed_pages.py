"""On CPU a Pipe asks glibc to keep freed memory, so repeated allocations fault no pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).resolve().parent.parent / "helpers" / "freed_pages_workers.py"
PAGES = 16 * (1 << 20) // 4096 + 16 * (8 << 20) // 4096  # touched by a round of each size


def _fresh_process(**environment: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True,
                          env={**os.environ, **environment}, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _faulted(result: dict[str, object]) -> int:
    faults = result["faults"]
    assert isinstance(faults, dict)
    return sum(faults.values())


def test_a_cpu_pipe_keeps_freed_pages_for_the_next_allocations() -> None:
    result = _fresh_process()
    assert result["asked"] is True and result["kept"] is True
    assert _faulted(result) < 0.05 * PAGES, result


def test_an_opt_out_leaves_glibc_alone() -> None:
    # Under glibc's own dynamic thresholds, whether a round faults depends on what the
    # process freed before: only the decision is asserted here.
    result = _fresh_process(PIPESCHED_KEEP_PAGES="0")
    assert result["asked"] is True and result["kept"] is False


def test_the_users_own_malloc_setting_is_left_as_it_is() -> None:
    result = _fresh_process(MALLOC_TRIM_THRESHOLD_="131072")
    assert result["asked"] is True and result["kept"] is False
    # The user's fixed thresholds, not ours: each round gives its pages back and faults them
    # in again.
    assert _faulted(result) > 0.5 * PAGES, result
