"""Every collective is bounded by the Pipe's timeout: a silent peer is an error, not a hang.

Rank 1 builds four Pipes (``timeout=2``) and goes silent for 11 s; rank 0 calls
``gather_state_dict``, ``step``, ``predict`` and ``close`` on them in turn, then
``save_state_dict``: each returns or raises within 6 s (``BOUND``: the timeout and room for
a loaded machine, while a wait until the silent rank wakes, or for the Pipe's 60 s
default, is longer). In a (2, 2) mesh, a replica whose step fails or stalls is a PeerError
within 6 s on every rank that waits for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

import bounded_workers
from bounded_workers import BOUND
from dist_harness import in_turn, run_ranks

TWO_RANK_CALLS = {"dropped": (bounded_workers.dropped_pipes, (20,)),
                  "gloo": (bounded_workers.lone_validation, ("gloo",)),
                  "ordered": (bounded_workers.lone_validation, ("ordered",)),
                  "silent": (bounded_workers.silent_during_every_call, ())}


@pytest.fixture(scope="module")
def launches() -> Iterator[dict[str, Future[list[Any]]]]:
    """Both launches of this file at once, 2 ranks and 4: their ranks mostly wait (for a
    timeout, a silent rank, a stalled replica), so the waits overlap instead of adding up."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {
            "two_ranks": pool.submit(run_ranks, in_turn, 2, list(TWO_RANK_CALLS.values()),
                                     timeout=240),
            "replica_failures": pool.submit(run_ranks, in_turn, 4,
                                            [(bounded_workers.replica_fails, case)
                                             for case in REPLICA_FAILURES], timeout=280),
        }


@pytest.fixture(scope="module")
def two_ranks(launches: dict[str, Future[list[Any]]]) -> dict[str, list[Any]]:
    """One launch of 2 ranks: ``dropped_pipes`` on the world group, the gloo then the ordered
    transport's ``lone_validation`` (each leaves the Pipe on its fresh group broken), and
    ``silent_during_every_call`` last, whose Pipes are on fresh groups and whose rank 1 goes
    silent. Per call, each rank's result."""
    per_rank = launches["two_ranks"].result()
    return {name: [results[index] for results in per_rank]
            for index, name in enumerate(TWO_RANK_CALLS)}


def test_a_silent_peer_bounds_every_call_by_the_timeout(two_ranks: dict[str, list[Any]]) -> None:
    waiting, silent = two_ranks["silent"]
    assert silent == []
    assert [name for name, _, _ in waiting] == [
        "gather_state_dict", "step", "predict", "close", "save_state_dict"]
    for name, outcome, seconds in waiting:
        assert seconds < BOUND, (name, outcome, seconds)
        if name in ("gather_state_dict", "step", "predict"):
            assert outcome.startswith("PeerError"), (name, outcome)


def test_pipes_dropped_without_close_release_their_descriptors(
        two_ranks: dict[str, list[Any]]) -> None:
    for before, after in two_ranks["dropped"]:
        assert after <= before + 5, (before, after)  # 5 a Pipe before: 100 more


@pytest.mark.parametrize("transport", ["gloo", "ordered"])
def test_a_call_one_rank_makes_alone_is_an_error_on_every_rank(
        transport: str, two_ranks: dict[str, list[Any]]) -> None:
    """Rank 0 validates alone (pipe(x)), then both step: no rank trains on the other call's
    activations; each rank's calls end within the bound, each rank gets an error, and no
    gradient was touched."""
    first, second = two_ranks[transport]
    for calls in (first, second):
        *outcomes, (_, untouched, _) = calls
        assert untouched == "True", calls
        assert all(seconds < BOUND for _, _, seconds in outcomes), calls
        assert any(outcome.startswith("PeerError") for _, outcome, _ in outcomes), calls
    assert "made different calls" in second[0][1], second


# (data parallelism, stage, failing global rank, how): on (pp, dp) = (2, 2) stage 0 is held
# by ranks 0 and 1, stage 1 by ranks 2 and 3; pipelines are (0, 2) and (1, 3).
REPLICA_FAILURES = (
    ("fsdp", 1, 2, "raise"),  # the other replica of stage 1 waited in the reduce-scatter
    ("fsdp", 0, 0, "raise"),  # rank 2 never gathered: rank 3 waited in the all-gather
    ("replicate", 1, 2, "raise"),  # waited for the timeout, not told
    ("fsdp", 1, 2, "stall"),  # a silent replica
)


@pytest.fixture(scope="module")
def replica_failures(launches: dict[str, Future[list[Any]]]
                     ) -> list[list[tuple[str, float, bool]]]:
    """One launch of 4 ranks, each case on its own mesh in turn: per rank, per case, its
    step's (outcome, seconds, gradients untouched)."""
    return launches["replica_failures"].result()


@pytest.mark.parametrize("case", range(len(REPLICA_FAILURES)))
def test_a_failing_replica_is_a_peer_error_on_every_waiting_rank_within_the_bound(
        replica_failures: list[list[tuple[str, float, bool]]], case: int) -> None:
    """Pipe(timeout=TIMEOUT): every rank but the failing one raises PeerError within BOUND
    seconds (no raw gloo error, no wait until the failed rank's process ends); the replicas of
    the failing rank's stage name it; no rank reduced or kept a gradient of the step."""
    data_parallel, stage, failing, how = REPLICA_FAILURES[case]
    for rank, cases in enumerate(replica_failures):
        outcome, seconds, untouched = cases[case]
        assert untouched, (rank, outcome)
        if rank == failing:
            if how == "raise":
                assert outcome.startswith("StageError") and "replica's stage fails" in outcome
            continue
        assert outcome.startswith("PeerError"), (rank, outcome)
        assert seconds < BOUND, (rank, outcome, seconds)
        if rank // 2 == failing // 2 and how == "raise":  # its stage's other replica
            assert f"rank {failing}, a data-parallel replica of this stage, failed" in outcome
