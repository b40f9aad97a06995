"""Pipe(schedule="auto", chunks="auto"): the planner's pick, run with exact gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dist_harness import run_ranks
from dist_workers import auto_plan
from models import batch, build

from pipeline import Pipe, Sample

TOLERANCE = 1e-10


def test_auto_runs_the_plans_pick_exactly() -> None:
    model = build("mlp")
    reference = copy.deepcopy(model)
    x, y = batch("mlp", 16)
    nn.MSELoss()(reference(x), y).backward()
    pipe = Pipe(model, chunks="auto", schedule="auto", devices=["cpu", "cpu"], sample=x,
                loss_fn=nn.MSELoss())
    plan = pipe.plan
    fastest = min(c.predicted.makespan for c in plan.candidates if c.fits)
    assert plan.predicted.makespan == fastest
    assert (pipe.schedule.name, pipe.chunks, pipe.balance, pipe.checkpoint) == (
        plan.schedule, plan.microbatches, list(plan.balance), plan.checkpoint)
    pipe.step(x, y)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=TOLERANCE, rtol=0)


def test_auto_with_a_fixed_schedule_or_count_plans_the_rest() -> None:
    x, _ = batch("mlp", 16)
    pipe = Pipe(build("mlp"), chunks=4, schedule="auto", devices=["cpu", "cpu"], sample=x,
                loss_fn=nn.MSELoss(), checkpoint="never")
    assert pipe.chunks == 4 and pipe.checkpoint == "never"
    assert {c.microbatches for c in pipe.plan.candidates} == {4}
    pipe = Pipe(build("mlp"), chunks="auto", schedule="gpipe", devices=["cpu", "cpu"], sample=x,
                loss_fn=nn.MSELoss())
    assert {c.schedule for c in pipe.plan.candidates} == {"gpipe"}


def test_auto_needs_a_sample_and_a_limit_that_something_fits() -> None:
    with pytest.raises(ValueError, match=r"needs a batch to profile: pass sample=x"):
        Pipe(build("mlp"), chunks="auto", schedule="auto", devices=["cpu", "cpu"],
             loss_fn=nn.MSELoss())
    x, _ = batch("mlp", 16)
    with pytest.raises(ValueError, match=r"memory"):
        Pipe(build("mlp"), chunks="auto", schedule="auto", devices=["cpu", "cpu"], sample=x,
             loss_fn=nn.MSELoss(), memory_limit=1)


def test_rank_zero_plans_and_every_rank_runs_the_same_pick() -> None:
    results = run_ranks(auto_plan, 2)
    assert results[0][0] == results[1][0]
    for _, error, _ in results:
        assert error < TOLERANCE
    assert sum(compared for _, _, compared in results) == 16


def test_a_sample_target_has_the_loss_profiled_for_the_plan() -> None:
    x, y = batch("mlp", 16)
    seen: list[tuple[int, ...]] = []

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(target.shape))
        return nn.functional.mse_loss(output, target)

    Pipe(build("mlp"), chunks=4, schedule="auto", checkpoint="never", devices=["cpu", "cpu"],
         sample=x, loss_fn=loss_fn)
    assert seen == []  # no target: the plan has no loss in it
    Pipe(build("mlp"), chunks=4, schedule="auto", checkpoint="never", devices=["cpu", "cpu"],
         sample=Sample(x, y), loss_fn=loss_fn)
    assert seen and all(shape == (4,) + tuple(y.shape[1:]) for shape in seen)


def test_the_losss_saved_bytes_are_held_by_the_last_chunk() -> None:
    from partitioners import LayerCost, LossCost, Profile
    from partitioners.plan.costs import chunk_sums

    layers = Profile([LayerCost(forward=1.0, backward=1.0, saved_bytes=10)] * 4,
                     loss=LossCost(forward=0.5, backward=0.5, saved_bytes=7))
    assert chunk_sums(layers, [2, 2]).saved == (20, 27)


def test_auto_on_a_gpt_with_a_tied_head_and_padding_is_exact_under_a_memory_limit() -> None:
    # The tied head's copy, the token-weighted loss with an all-padding row, and a limit
    # that rules out the unlimited pick: whatever schedule, count, cut and recomputation
    # the plan takes, the step equals the unpipelined model's, and the pick fits.
    import zoo

    x, y = zoo.gpt_batch()
    expected_loss, expected = zoo.reference_grads(zoo.tiny_gpt(), x, y, zoo.gpt_loss())
    options = {"chunks": "auto", "schedule": "auto", "devices": ["cpu", "cpu"],
               "sample": Sample(x, y), "loss_fn": zoo.gpt_loss()}
    free = Pipe(zoo.tiny_gpt(), **options)
    leanest = min(max(c.peak_memory) for c in free.plan.candidates)
    unlimited = max(free.plan.peak_memory)
    assert leanest <= unlimited
    # On a loaded machine the fastest measured pick can be the leanest too; a limit can
    # then only hold the plan to it.
    limit = (leanest + unlimited) / 2 if leanest < unlimited else leanest
    model = zoo.tiny_gpt()
    pipe = Pipe(model, memory_limit=limit, **options)
    assert max(pipe.plan.peak_memory) <= limit
    loss = float(pipe.step(x, y))
    assert abs(loss - expected_loss) < TOLERANCE
    error, compared = zoo.grad_errors(model, expected)
    assert error < TOLERANCE and len(compared) == len(expected)
