"""Overlapped pairs in the runtime: a pair's forward runs in the turns its backward leaves,
gives the same numbers as the plain timetable, and its failures surface."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from pipeline import Pipe
from pipeline.runtime.expert_parallel import unmatched_pairs
from schedules import get_schedule
from pipeline.runtime.paired import run_pair, while_in_flight


def test_a_pair_interleaves_at_each_exchange_and_returns_both_results() -> None:
    trace: list[str] = []

    def forward() -> str:
        trace.append("F computes")
        assert while_in_flight()  # issued: the backward's turn
        trace.append("F goes on")
        return "f"

    def backward() -> str:
        trace.append("B computes")
        assert while_in_flight()  # issued: the forward's turn
        trace.append("B goes on")
        assert while_in_flight()  # the forward's second turn: it ends
        trace.append("B ends")
        assert not while_in_flight()  # the forward has ended: nothing to give
        return "b"

    forward_result, backward_result, _ = run_pair(forward, backward)
    assert (forward_result, backward_result) == ("f", "b")
    assert trace == ["B computes", "F computes", "B goes on", "F goes on", "B ends"]
    assert not while_in_flight()  # outside a pair, nothing happens


def test_a_pair_forward_sees_the_callers_grad_mode_and_its_error_surfaces() -> None:
    seen = []

    def forward() -> None:
        seen.append((torch.is_grad_enabled(), threading.current_thread().name))
        raise ValueError("forward failed")

    with torch.no_grad(), pytest.raises(ValueError, match="forward failed"):
        run_pair(forward, lambda: None)
    assert seen == [(False, "pipesched-pair-forward")]


def test_a_failed_backward_unwinds_the_waiting_forward() -> None:
    unwound = []

    def forward() -> None:
        try:
            while_in_flight()
        finally:
            unwound.append(True)

    def backward() -> None:
        while_in_flight()
        raise RuntimeError("backward failed")

    with pytest.raises(RuntimeError, match="backward failed"):
        run_pair(forward, backward)
    assert unwound == [True]


def test_dualpipe_v_pairs_train_exactly_as_its_plain_timetable() -> None:
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]).double()
    x, y = torch.randn(8, 8, dtype=torch.double), torch.randn(8, 8, dtype=torch.double)
    found = []
    for overlap in (False, True):
        model = copy.deepcopy(base)
        with Pipe(model, chunks=4, schedule="dualpipe-v", devices=["cpu", "cpu"],
                  schedule_options={"overlap": overlap},
                  loss_fn=lambda out, target: ((out - target) ** 2).sum()) as pipe:
            loss = pipe.step(x, y)
            assert any(pipe.schedule.pairs) == overlap
        found.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    assert found[0][0] == found[1][0]
    assert all(torch.equal(a, b) for a, b in zip(found[0][1], found[1][1]))


def test_pairs_of_chunks_with_unequal_experts_are_named() -> None:
    schedule = get_schedule("dualpipe-v", 2, 5, overlap=True)
    assert unmatched_pairs(schedule, 1, {1: 4, 2: 4}) == []
    assert unmatched_pairs(schedule, 1, {1: 4, 2: 2}) == [(1, 2, 4, 2), (2, 1, 2, 4)]
    assert unmatched_pairs(get_schedule("dualpipe-v", 2, 5), 1, {1: 4, 2: 2}) == []
