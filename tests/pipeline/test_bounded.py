"""Every collective is bounded by the Pipe's timeout: a silent peer is an error, not a hang.

Rank 1 builds four Pipes (``timeout=3``) and goes silent for 16 s; rank 0 calls
``gather_state_dict``, ``step``, ``predict`` and ``close`` on them in turn, then
``save_state_dict``: each returns or raises within 10 s.
"""

from __future__ import annotations

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
