"""The real distributed runtime under NCCL's rules, on gloo: every schedule, exact, no hang.

``Pipe(..., transport="ordered")`` executes the comm plan the way it runs under
NCCL (tags ignored, one communicator per channel, messages matched in posting
order) and, on gloo, waits for every send to be received before moving past its
group: the worst case NCCL allows. A plan or a runtime that could hang on a GPU
cluster hangs here, and the timeout turns that into a failure.
"""

from __future__ import annotations

from dist_harness import run_ranks
from dist_workers import equivalence, naive_plan_under_nccl_rules

from schedules import schedule_names

TOLERANCE = 1e-10


def _check(rows_by_rank: list[list[tuple]]) -> None:
    for rank, rows in enumerate(rows_by_rank):
        for schedule, mode, chunks, loss_error, grad_error, compared in rows:
            where = f"rank {rank}, {schedule}, checkpoint={mode}, chunks={chunks}"
            assert loss_error < TOLERANCE and grad_error < TOLERANCE, where
            assert compared > 0, f"{where}: no local gradients"


def test_every_schedule_on_two_ranks_under_nccl_rules() -> None:
    rows = run_ranks(equivalence, 2, schedule_names(), (4, 5), "ordered",
                     ("always", "never"), 30.0, timeout=240)
    assert len(rows[0]) == len(schedule_names()) * 2 * 2
    _check(rows)


def test_every_schedule_on_four_ranks_under_nccl_rules() -> None:
    rows = run_ranks(equivalence, 4, schedule_names(), (8,), "ordered", ("except_last",), 30.0,
                     timeout=240)
    assert len(rows[0]) == len(schedule_names())
    _check(rows)


def test_the_old_posting_order_hangs_under_the_same_rules_and_times_out() -> None:
    results = run_ranks(naive_plan_under_nccl_rules, 2, timeout=60)
    for outcome, seconds, message in results:
        assert outcome == "PeerError", "the check would not catch a hang"
        assert seconds < 10
    assert any("waited 3s" in message for _, _, message in results)
