"""The planner's tensor parallelism: a unit's share of its measured work and bytes on one tp
rank, and Megatron's all-reduces (a ring each), against the closed form."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioners import LayerCost, plan, plan_for_model
from partitioners.plan.tensor_parallel import TensorParallelism, split_costs
from schedules import Link

LINK = Link(latency=1e-5, bandwidth=1e9)
BLOCK = LayerCost(forward=1.0, backward=2.0, param_bytes=1000, activation_bytes=10**6,
                  saved_bytes=400, backward_input=1.2, backward_weight=0.8, weight_bytes=300)


def test_a_split_block_runs_its_share_and_pays_two_all_reduces_each_way() -> None:
    tp = TensorParallelism(size=2, split=(1.0, 0.0), reductions=(2, 0), link=LINK)
    block, norm = split_costs([BLOCK, BLOCK], tp)
    ring = 2 * 1 * (1e-5 + 10**6 / 2 / 1e9)  # reduce-scatter then all-gather over 2 ranks
    assert block.forward == pytest.approx(0.5 + 2 * ring)
    assert block.backward == pytest.approx(1.0 + 2 * ring)
    assert block.backward_input == pytest.approx(0.6 + 2 * ring)
    assert block.backward_weight == pytest.approx(0.4)  # a local product: no all-reduce
    assert (block.param_bytes, block.saved_bytes, block.weight_bytes) == (500, 200, 150)
    assert norm == BLOCK  # nothing split, nothing reduced


def test_tensor_parallelism_that_describes_other_units_is_refused() -> None:
    with pytest.raises(ValueError, match="describes 1 units, the profile has 2"):
        split_costs([BLOCK, BLOCK], TensorParallelism(2, (1.0,), (2,), LINK))
    with pytest.raises(ValueError, match="shares in"):
        TensorParallelism(2, (1.5,), (2,), LINK)


def test_the_plan_prices_a_stage_split_over_tp_ranks() -> None:
    """Four equal blocks on 2 stages: over 4 tp ranks on a fast link each stage's step is
    about a quarter, and its parameters a quarter; on a slow link the all-reduces show."""
    costs = [BLOCK] * 4
    alone = plan(lambda rows: costs, 2, 8, schedules=["1f1b"], checkpoints=["never"],
                 microbatch_counts=[4])
    fast = TensorParallelism(4, (1.0,) * 4, (2,) * 4, Link(latency=0.0, bandwidth=1e15))
    slow = TensorParallelism(4, (1.0,) * 4, (2,) * 4, Link(latency=0.0, bandwidth=1e7))
    split = plan(lambda rows: split_costs(costs, fast), 2, 8, schedules=["1f1b"],
                 checkpoints=["never"], microbatch_counts=[4])
    slowed = plan(lambda rows: split_costs(costs, slow), 2, 8, schedules=["1f1b"],
                  checkpoints=["never"], microbatch_counts=[4])
    assert split.predicted.makespan == pytest.approx(alone.predicted.makespan / 4, rel=1e-6)
    assert slowed.predicted.makespan > alone.predicted.makespan / 4 + 1.0
    assert split.peak_memory[0] < alone.peak_memory[0]


def test_plan_for_model_takes_tensor_parallelism() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    sample = torch.randn(8, 64)
    tp = TensorParallelism(2, (1.0,) * 4, (1,) * 4, LINK)
    found = plan_for_model(model, sample, stages=2, schedules=["1f1b"], checkpoints=["never"],
                           microbatch_counts=[2], tensor_parallel=tp, repeat=1)
    assert found.schedule == "1f1b" and found.microbatches == 2
