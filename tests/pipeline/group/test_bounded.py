"""Every collective is bounded by the Pipe's timeout: a silent peer is an error, not a hang.

Rank 1 builds four Pipes (``timeout=2``) and goes silent for 13 s; rank 0 calls
``gather_state_dict``, ``step``, ``predict`` and ``close`` on them in turn, then
``save_state_dict``: each returns or raises within 10 s. In a (2, 2) mesh, a replica
whose step fails or stalls is a PeerError within 10 s on every rank that waits for it.
"""

from __future__ import annotations

from typing import Any

import pytest

import bounded_workers
from dist_harness import in_turn, run_ranks


@pytest.fixture(scope="module")
def alone_then_silent() -> list[tuple[Any, Any]]:
    """One spawn of 2 ranks (each spawn costs seconds): the ordered transport's
    ``lone_validation``, whose Pipe on the world group it leaves broken, then
    ``silent_during_every_call``, whose Pipes are on fresh groups. Per rank, both."""
    calls = [(bounded_workers.lone_validation, ("ordered",)),
             (bounded_workers.silent_during_every_call, ())]
    return run_ranks(in_turn, 2, calls, timeout=240)


def test_a_silent_peer_bounds_every_call_by_the_timeout(
        alone_then_silent: list[tuple[Any, Any]]) -> None:
    waiting, silent = [silent for _, silent in alone_then_silent]
    assert silent == []
    assert [name for name, _, _ in waiting] == [
        "gather_state_dict", "step", "predict", "close", "save_state_dict"]
    for name, outcome, seconds in waiting:
        assert seconds < 10, (name, outcome, seconds)
        if name in ("gather_state_dict", "step", "predict"):
            assert outcome.startswith("PeerError"), (name, outcome)


@pytest.fixture(scope="module")
def dropped_then_alone() -> list[tuple[tuple[int, int], Any]]:
    """One spawn of 2 ranks (each spawn costs seconds): ``dropped_pipes``, then the gloo
    transport's ``lone_validation``, which leaves its Pipe broken, last. Per rank, both."""
    calls = [(bounded_workers.dropped_pipes, (20,)), (bounded_workers.lone_validation, ("gloo",))]
    return run_ranks(in_turn, 2, calls, timeout=240)


def test_pipes_dropped_without_close_release_their_descriptors(
        dropped_then_alone: list[tuple[tuple[int, int], Any]]) -> None:
    for (before, after), _ in dropped_then_alone:
        assert after <= before + 5, (before, after)  # 5 a Pipe before: 100 more


@pytest.mark.parametrize("transport", ["gloo", "ordered"])
def test_a_call_one_rank_makes_alone_is_an_error_on_every_rank(
        transport: str, request: pytest.FixtureRequest) -> None:
    """Rank 0 validates alone (pipe(x)), then both step: no rank trains on the other call's
    activations; each rank's calls end within 10 s, each rank gets an error, and no gradient
    was touched."""
    if transport == "gloo":
        first, second = [alone for _, alone in request.getfixturevalue("dropped_then_alone")]
    else:
        first, second = [alone for alone, _ in request.getfixturevalue("alone_then_silent")]
    for calls in (first, second):
        *outcomes, (_, untouched, _) = calls
        assert untouched == "True", calls
        assert all(seconds < 10 for _, _, seconds in outcomes), calls
        assert any(outcome.startswith("PeerError") for _, outcome, _ in outcomes), calls
    assert "made different calls" in second[0][1], second


# (data parallelism, stage, failing global rank, how): on (pp, dp) = (2, 2) stage 0 is held
# by ranks 0 and 1, stage 1 by ranks 2 and 3; pipelines are (0, 2) and (1, 3).
REPLICA_FAILURES = (
    ("fsdp", 1, 2, "raise"),  # the other replica of stage 1 waited in the reduce-scatter
    ("fsdp", 0, 0, "raise"),  # rank 2 never gathered: rank 3 waited in the all-gather
    ("replicate", 1, 2, "raise"),  # waited for the timeout, not told
    ("fsdp", 1, 2, "stall"),  # a silent replica (last: the others leave before it does)
)


@pytest.fixture(scope="module")
def replica_failures() -> list[list[tuple[str, float, bool]]]:
    """One spawn of 4 ranks, each case on its own mesh in turn: per rank, per case, its
    step's (outcome, seconds, gradients untouched)."""
    calls = [(bounded_workers.replica_fails, case) for case in REPLICA_FAILURES]
    return run_ranks(in_turn, 4, calls, timeout=280)


@pytest.mark.parametrize("case", range(len(REPLICA_FAILURES)))
def test_a_failing_replica_is_a_peer_error_on_every_waiting_rank_within_the_bound(
        replica_failures: list[list[tuple[str, float, bool]]], case: int) -> None:
    """Pipe(timeout=5): every rank but the failing one raises PeerError within 10 s (no raw
    gloo error, no wait until the failed rank's process ends); the replicas of the failing
    rank's stage name it; no rank reduced or kept a gradient of the step."""
    data_parallel, stage, failing, how = REPLICA_FAILURES[case]
    for rank, cases in enumerate(replica_failures):
        outcome, seconds, untouched = cases[case]
        assert untouched, (rank, outcome)
        if rank == failing:
            if how == "raise":
                assert outcome.startswith("StageError") and "replica's stage fails" in outcome
            continue
        assert outcome.startswith("PeerError"), (rank, outcome)
        assert seconds < 10, (rank, outcome, seconds)
        if rank // 2 == failing // 2 and how == "raise":  # its stage's other replica
            assert f"rank {failing}, a data-parallel replica of this stage, failed" in outcome
