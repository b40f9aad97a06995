"""Every collective is bounded by the Pipe's timeout: a silent peer is an error, not a hang.

Rank 1 builds four Pipes (``timeout=3``) and goes silent for 16 s; rank 0 calls
``gather_state_dict``, ``step``, ``predict`` and ``close`` on them in turn, then
``save_state_dict``: each returns or raises within 10 s.
"""

from __future__ import annotations

import pytest

import bounded_workers
from dist_harness import run_ranks


def test_a_silent_peer_bounds_every_call_by_the_timeout() -> None:
    waiting, silent = run_ranks(bounded_workers.silent_during_every_call, 2, timeout=120)
    assert silent == []
    assert [name for name, _, _ in waiting] == [
        "gather_state_dict", "step", "predict", "close", "save_state_dict"]
    for name, outcome, seconds in waiting:
        assert seconds < 10, (name, outcome, seconds)
        if name in ("gather_state_dict", "step", "predict"):
            assert outcome.startswith("PeerError"), (name, outcome)


def test_pipes_dropped_without_close_release_their_descriptors() -> None:
    for before, after in run_ranks(bounded_workers.dropped_pipes, 2, 20, timeout=180):
        assert after <= before + 5, (before, after)  # 5 a Pipe before: 100 more


@pytest.mark.parametrize("transport", ["gloo", "ordered"])
def test_a_call_one_rank_makes_alone_is_an_error_on_every_rank(transport: str) -> None:
    """Rank 0 validates alone (pipe(x)), then both step: no rank trains on the other call's
    activations; each rank's calls end within 10 s, each rank gets an error, and no gradient
    was touched."""
    first, second = run_ranks(bounded_workers.lone_validation, 2, transport, timeout=120)
    for calls in (first, second):
        *outcomes, (_, untouched, _) = calls
        assert untouched == "True", calls
        assert all(seconds < 10 for _, _, seconds in outcomes), calls
        assert any(outcome.startswith("PeerError") for _, outcome, _ in outcomes), calls
    assert "made different calls" in second[0][1], second
