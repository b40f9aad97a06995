"""On CPU a Pipe asks glibc to keep freed memory, so repeated allocations fault no pages."""

from __future__ import annotations

import pytest
from freed_pages_workers import faults_after_a_cpu_pipe

from pipeline.group.launch import run_ranks

PAGES = {1 << 20: 16 * (1 << 20) // 4096, 8 << 20: 16 * (8 << 20) // 4096}


def test_a_cpu_pipe_keeps_freed_pages_for_the_next_allocations() -> None:
    [result] = run_ranks(faults_after_a_cpu_pipe, 1)
    assert result["kept"] is True
    assert result["faults"] == {size: 0 for size in PAGES}, result


@pytest.mark.parametrize("setting", [("PIPESCHED_KEEP_PAGES", "0"),
                                     ("MALLOC_TRIM_THRESHOLD_", "131072")])
def test_an_opt_out_or_the_users_own_malloc_setting_leaves_glibc_alone(
        setting: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(*setting)
    [result] = run_ranks(faults_after_a_cpu_pipe, 1)
    assert result["kept"] is False
    # glibc's own thresholds: the rounds give pages back and fault them in again.
    assert sum(result["faults"].values()) > 0.05 * sum(PAGES.values()), result
