"""Pipelines in a device mesh: FSDP2 inside each stage along ``"dp"``, exact and sharded.

The truth is the unpipelined model on the union of the replicas' batches (the test GPT:
a head tied to the embedding on another stage, padded targets whose counts differ
between replicas). A sharded pipeline must match it to 1e-10 in float64 under 1F1B and
the split-backward schedules, with and without recomputation; hold a quarter of the
parameter, gradient and Adam bytes over 4 replicas; gather each FSDP unit once and
reduce-scatter it once per step; and keep the habits of a training loop exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zoo
from dist_harness import run_ranks
from mesh_workers import (
    CHUNKS,
    STEPS_AFTER_LOAD,
    STEPS_BEFORE_SAVE,
    adam,
    collectives,
    gpt_exact,
    habits,
    held_parameters,
    random_equal,
    reference_parameters,
    refusals,
    sharded_resume,
    sharded_save,
    state_bytes,
    step_batch,
)

EXACT = 1e-10
SPLIT_AND_NOT = ("1f1b", "zb-h1", "zb-v")


@pytest.mark.parametrize("data_parallel", ["fsdp", "replicate"])
def test_a_pp_by_dp_mesh_is_exact_on_the_union_batch(data_parallel: str) -> None:
    modes = ("never", "always") if data_parallel == "fsdp" else ("except_last",)
    for rows in run_ranks(gpt_exact, 4, (2, 2), SPLIT_AND_NOT, modes, data_parallel):
        assert len(rows) == len(SPLIT_AND_NOT) * len(modes)
        for schedule, mode, loss_error, grad_error, compared in rows:
            assert loss_error < EXACT, (schedule, mode, loss_error)
            assert grad_error < EXACT, (schedule, mode, grad_error)
            assert compared >= 15, (schedule, mode, compared)


def test_resharding_after_each_forward_stays_exact() -> None:
    for rows in run_ranks(gpt_exact, 4, (2, 2), ("1f1b", "zb-v"), ("except_last",), "fsdp", True):
        for schedule, mode, loss_error, grad_error, _ in rows:
            assert loss_error < EXACT and grad_error < EXACT, (schedule, mode)


def test_one_stage_over_four_replicas_is_exact() -> None:
    for rows in run_ranks(gpt_exact, 4, (1, 4), ("1f1b",), ("except_last",), "fsdp"):
        (_, _, loss_error, grad_error, compared), = rows
        assert loss_error < EXACT and grad_error < EXACT
        assert compared == 41  # every parameter of the GPT, on one stage


def test_dropout_under_one_seed_gives_the_replicas_gradients() -> None:
    assert run_ranks(random_equal, 4, (2, 2), "zb-h1") == [0.0] * 4


def test_each_unit_is_gathered_once_and_reduced_once_per_step() -> None:
    for units, counted in run_ranks(collectives, 4, False):
        assert units == 3  # three layers per stage, each a unit
        assert counted == {"all_gather": units, "reduce_scatter": units}
    for units, counted in run_ranks(collectives, 4, True):
        # Gathered for each of the 4 micro-batches' forward and again for its backward.
        assert counted == {"all_gather": 2 * 4 * units, "reduce_scatter": units}


def test_four_replicas_hold_a_quarter_of_the_parameters_gradients_and_adam_state() -> None:
    for held in run_ranks(state_bytes, 4):
        assert held["fsdp"] <= (0.25 + 0.05) * held["replicate"], held
        assert held["fsdp"] < 0.26 * held["replicate"], held


def test_accumulation_clipping_and_inference_under_fsdp() -> None:
    for found in run_ranks(habits, 4):
        assert found["accumulated"] < EXACT
        assert found["norm"] < EXACT and found["clipped"] < EXACT
        assert found["inference"] < EXACT
        assert found["gathered_after"] == 0  # a forward-only call frees what it gathered
        assert 0.45 < found["held"] < 0.55  # half of the stage's elements over 2 replicas


def test_unknown_data_parallelism_is_refused_by_name() -> None:
    for said in run_ranks(refusals, 4):
        assert said == [
            "unknown data_parallel 'zero'; expected one of: replicate, fsdp",
            "reshard_after_forward=True applies to data_parallel='fsdp' only, got "
            "data_parallel='replicate'",
        ]


# -- a sharded checkpoint resumes on other layouts -------------------------------------------


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("sharded") / "checkpoint"
    for sharded, held in run_ranks(sharded_save, 4, str(directory)):
        assert sharded == held > 0
    return directory


@pytest.mark.parametrize("shape, data_parallel", [((4, 1), "replicate"), ((2, 2), "fsdp")])
def test_a_sharded_checkpoint_resumes_on_ranks_exactly(
        sharded_checkpoint: Path, shape: tuple[int, int], data_parallel: str) -> None:
    for step, error, compared in run_ranks(sharded_resume, 4, str(sharded_checkpoint), shape,
                                           data_parallel):
        assert step == STEPS_BEFORE_SAVE
        assert error < EXACT and compared > 0


def test_a_sharded_checkpoint_resumes_in_one_process_and_unpipelined(
        sharded_checkpoint: Path) -> None:
    from pipeline import Pipe, load_checkpoint, load_into_model

    torch.set_num_threads(1)
    expected = reference_parameters(STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD)
    one_stage = Pipe(zoo.tiny_gpt(seed=99), CHUNKS, devices=["cpu"], loss_fn=zoo.gpt_loss())
    plain = zoo.tiny_gpt(seed=98)
    for model, optimizer, load in (
        (one_stage.model, adam(one_stage.parameters()), load_checkpoint),
        (plain, adam(plain.parameters()), load_into_model),
    ):
        target = one_stage if load is load_checkpoint else plain
        assert load(target, optimizer, sharded_checkpoint) == STEPS_BEFORE_SAVE
        for step in range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD):
            x, y = step_batch(step)
            optimizer.zero_grad()
            if target is one_stage:
                one_stage.step(x, y)
            else:
                zoo.gpt_loss()(plain(x), y).backward()
            optimizer.step()
        found = held_parameters(model)
        assert sorted(found) == sorted(expected)
        assert max(zoo.difference(found[k], expected[k]) for k in found) < EXACT
