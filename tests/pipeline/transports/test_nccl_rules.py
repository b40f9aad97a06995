"""The real distributed runtime under NCCL's rules, on gloo: every schedule, exact, no hang.

``Pipe(..., distributed=Distributed(group, transport="ordered"))`` executes the comm
plan the way it runs under NCCL (tags ignored, one communicator per channel, messages
matched in posting order) and, on gloo, waits for every send to be received before
moving past its group: the worst case NCCL allows. A plan or a runtime that could hang
on a GPU cluster hangs here, and the timeout turns that into a failure.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from dist_harness import in_turn, run_ranks
from dist_workers import equivalence, naive_plan_under_nccl_rules

from schedules import CommPlan, Group, Op, comm_plan, forward_only, get_schedule, schedule_names

TOLERANCE = 1e-10


def _check(rows_by_rank: list[list[tuple]]) -> None:
    for rank, rows in enumerate(rows_by_rank):
        for schedule, mode, chunks, loss_error, grad_error, compared in rows:
            where = f"rank {rank}, {schedule}, checkpoint={mode}, chunks={chunks}"
            assert loss_error < TOLERANCE and grad_error < TOLERANCE, where
            assert compared > 0, f"{where}: no local gradients"


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """One spawn of 2 ranks for every 2-rank test (each spawn costs seconds), the rank
    functions in turn: per rank, each result by name; the plan that hangs goes last."""
    calls = {
        "equivalence": (equivalence, (schedule_names(), (4, 5), "ordered", ("always", "never"),
                                      30.0)),
        "channels": (gloo_channels_follow_the_plan, ()),
        "naive": (naive_plan_under_nccl_rules, ()),
    }
    return [dict(zip(calls, results))
            for results in run_ranks(in_turn, 2, list(calls.values()), timeout=300)]


def test_every_schedule_on_two_ranks_under_nccl_rules(two_ranks: list[dict[str, Any]]) -> None:
    rows = [found["equivalence"] for found in two_ranks]
    assert len(rows[0]) == len(schedule_names()) * 2 * 2
    _check(rows)


def test_every_schedule_on_four_ranks_under_nccl_rules() -> None:
    rows = run_ranks(equivalence, 4, schedule_names(), (8,), "ordered", ("except_last",), 30.0,
                     timeout=240)
    assert len(rows[0]) == len(schedule_names())
    _check(rows)


def test_the_old_posting_order_hangs_under_the_same_rules_and_times_out(
        two_ranks: list[dict[str, Any]]) -> None:
    results = [found["naive"] for found in two_ranks]
    for outcome, seconds, message in results:
        assert outcome == "PeerError", "the check would not catch a hang"
        assert seconds < 10
    assert any("waited 3s" in message for _, _, message in results)


# -- the gloo transport takes each message's channel from the plan ---------------------------


def _recast(plan: CommPlan, channel_of: dict[Op, int], strategy: str) -> CommPlan:
    """``plan`` with each message on ``channel_of[its producer's op]``."""
    stages = tuple(
        tuple(Group(tuple(dataclasses.replace(op, channel=channel_of[op.producer.op])
                          for op in step.ops)) if isinstance(step, Group) else step
              for step in steps)
        for steps in plan.stages)
    return CommPlan(plan.schedule, stages, strategy)


def gloo_channels_follow_the_plan(rank: int, world: int) -> dict[str, Any]:
    """Walk hand-made plans through a GlooTransport and record, per message sent or received,
    the channel whose process group carried it. The training plan swaps comm_plan's
    channels (activations on 1, gradients on 0); the forward-only plan keeps them."""
    import torch
    import torch.distributed as dist

    from pipeline.transports.gloo import GlooTransport

    schedule = get_schedule("1f1b", stages=world, microbatches=3)
    training = _recast(comm_plan(schedule), {Op.F: 1, Op.B: 0}, "swapped")
    forward = _recast(comm_plan(forward_only(schedule)), {Op.F: 0}, "forward")
    transport = GlooTransport(dist.group.WORLD, list(range(world)), rank, torch.device("cpu"),
                              chunks=1, timeout=20.0)
    channel_of_group = {id(group): channel for channel, group in transport.groups.items()}
    seen: list[tuple[str, str, int, int, str]] = []  # (plan, op, micro-batch, channel, kind)
    plan_name = ""
    originals = dist.isend, dist.irecv

    def recording(function: Any, kind: str) -> Any:
        def call(tensor: torch.Tensor, peer: int, group: Any = None, tag: int = 0,
                 **options: Any) -> Any:
            code, microbatch = (tag // 2) % 4, (tag // 2) // 4  # addressing.message_tag with one chunk
            seen.append((plan_name, "FBIW"[code], microbatch, channel_of_group[id(group)], kind))
            return function(tensor, peer, group, tag=tag, **options)
        return call

    dist.isend, dist.irecv = recording(originals[0], "send"), recording(originals[1], "recv")
    received = []
    try:
        for step, (plan_name, plan) in enumerate(
                [("training", training), ("forward", forward), ("training", training)]):
            transport.begin_step(plan, rank)
            for group in plan.groups(rank):
                outgoing = {op.key: torch.full((2, 3 + step), 10.0 * step + op.key[1])
                            for op in group.ops if op.kind == "send"}
                transport.post(group, outgoing)
                for op in group.ops:
                    if op.kind == "recv":
                        payload = transport.take(op.key)
                        received.append(bool(torch.equal(
                            payload, torch.full((2, 3 + step), 10.0 * step + op.key[1]))))
            transport.finish()
        elsewhere = _recast(comm_plan(schedule), {Op.F: 0, Op.B: 2}, "on channel 2")
        try:
            transport.begin_step(elsewhere, rank)
            refusal = ""
        except ValueError as error:
            refusal = str(error)
    finally:
        dist.isend, dist.irecv = originals
        transport.close()
    return {"seen": seen, "received": received, "refusal": refusal}


def test_the_gloo_transport_sends_each_message_on_the_plans_channel(
        two_ranks: list[dict[str, Any]]) -> None:
    expected = {("training", "F"): 1, ("training", "B"): 0, ("forward", "F"): 0}
    for rank, result in enumerate(found["channels"] for found in two_ranks):
        assert result["received"] and all(result["received"]), f"rank {rank}: wrong payloads"
        seen = result["seen"]
        # Both plans' messages, both directions, and each plan's ops: all of them were seen.
        assert {(plan, op) for plan, op, _, _, _ in seen} == set(expected), seen
        assert {kind for *_, kind in seen} == {"send", "recv"}, seen
        wrong = [entry for entry in seen if entry[3] != expected[(entry[0], entry[1])]]
        assert wrong == [], f"rank {rank}: messages off the plan's channel: {wrong}"
        assert "channel(s) [2]" in result["refusal"] and "channels [0, 1] only" in \
            result["refusal"], result["refusal"]
