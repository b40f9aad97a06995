"""v-half, v-min, dualpipe-v and zb run in both runtimes with the unpipelined model's gradients."""

from __future__ import annotations

import copy

import pytest

from dist_harness import run_ranks
from dist_workers import equivalence
from models import batch, build, grads, loss_for, max_difference, reference
from pipeline import Pipe

TOLERANCE = 1e-10
ROWS = 13
MODES = ("always", "except_last", "never")
NEW = ("v-half", "v-min", "dualpipe-v", "zb")


def _check(name: str, schedule: str, checkpoint: str, stages: int, chunks: int,
           **options: object) -> None:
    model = build(name)
    x, target = batch(name, ROWS)
    expected_loss, expected = reference(model, x, target, loss_for(name))
    trained = copy.deepcopy(model)
    pipe = Pipe(trained, chunks, stages=stages, devices=["cpu"] * stages, schedule=schedule,
                checkpoint=checkpoint, loss_fn=loss_for(name), schedule_options=options)
    loss = pipe.step(x, target)
    where = f"{name} {schedule} {options} {checkpoint} P={stages} M={chunks}"
    assert abs(float(loss) - float(expected_loss)) < TOLERANCE, where
    difference = max_difference(grads(trained), expected)
    assert difference < TOLERANCE, f"{where}: gradients differ by {difference:.3g}"


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", NEW)
def test_one_process_every_checkpoint_mode(schedule: str, checkpoint: str) -> None:
    # 4 stages of two chunks make 8 chunks of the 9-layer models; M = 8 >= 2P for dualpipe-v.
    _check("residual_stack" if checkpoint == "never" else "mlp", schedule, checkpoint, 4, 8)
    _check("mlp", schedule, checkpoint, 2, 5)


@pytest.mark.parametrize("checkpoint", MODES)
def test_zb_between_h1_and_h2(checkpoint: str) -> None:
    _check("mlp", "zb", checkpoint, 4, 8, max_inflight=6)


def test_two_gloo_ranks_every_mode() -> None:
    rows = run_ranks(equivalence, 2, NEW, (4, 5))
    assert len(rows[0]) == len(NEW) * len(MODES) * 2
    for rank, rank_rows in enumerate(rows):
        for schedule, mode, chunks, loss_error, grad_error, compared in rank_rows:
            where = f"rank {rank}, {schedule}, checkpoint={mode}, chunks={chunks}"
            assert loss_error < TOLERANCE and grad_error < TOLERANCE, where
            assert compared > 0, where
