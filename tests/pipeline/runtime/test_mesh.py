"""Pipelines in a 3D device mesh: FSDP2 along ``"dp"`` and tensor parallelism along ``"tp"``
inside each stage, checkpoints that reshard between layouts.

The truth is the unpipelined model on the union of the replicas' batches (the test GPT:
a head tied to the embedding on another stage, padded targets whose counts differ
between replicas). A pipeline in a mesh must match it to 1e-10 in float64 under 1F1B
and the split-backward schedules, with and without recomputation, sharded or
replicated; hold a quarter of the parameter, gradient and Adam bytes over 4 replicas;
gather each FSDP unit once and reduce-scatter it once per step; keep the habits of a
training loop exact; and resume a sharded checkpoint on every other layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zoo
import mesh_workers
from dist_harness import in_turn, run_ranks
from mesh_workers import (
    CHUNKS,
    STEPS_AFTER_LOAD,
    STEPS_BEFORE_SAVE,
    adam,
    held_parameters,
    mesh_gpt,
    reference_parameters,
    step_batch,
)

EXACT = 1e-10


# Every shape of the bar, each with every schedule; each schedule with both kinds
# of data parallelism and both checkpoint modes across the shapes. (The whole product, 12
# combinations on every shape, takes minutes: benchmarks/mesh_exactness.py runs it.)
PATTERN = (("fsdp", "1f1b", "never"), ("replicate", "zb-h1", "always"), ("fsdp", "zb-v", "always"))
FLIPPED = tuple(("replicate" if dp == "fsdp" else "fsdp", schedule,
                 "always" if mode == "never" else "never") for dp, schedule, mode in PATTERN)


SHAPES = {(2, 2, 2): PATTERN, (2, 4, 1): FLIPPED, (4, 2, 1): FLIPPED, (2, 1, 4): PATTERN}


@pytest.fixture(scope="module")
def eight_ranks() -> list[dict[tuple[int, ...], Any]]:
    """One spawn of 8 ranks (spawning them costs seconds), a mesh per shape in turn: per
    rank, each shape's rows (``gpt_exact``)."""
    calls = [(mesh_workers.gpt_exact, (shape, combinations)) for shape, combinations in SHAPES.items()]
    return [dict(zip(SHAPES, results)) for results in run_ranks(in_turn, 8, calls)]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_eight_ranks_in_a_3d_mesh_are_exact_on_the_union_batch(
        eight_ranks: list[dict[tuple[int, ...], Any]], shape: tuple[int, int, int]) -> None:
    for found in eight_ranks:
        rows = found[shape]
        assert [row[0] for row in rows] == list(SHAPES[shape])
        for combination, loss_error, grad_error, compared in rows:
            assert loss_error < EXACT, (shape, combination, loss_error)
            assert grad_error < EXACT, (shape, combination, grad_error)
            assert compared > 0


RESHARDING = (("fsdp", "1f1b", "except_last"), ("fsdp", "zb-v", "except_last"))


CHECKPOINT_LAYOUTS = [((4, 1), "replicate"), ((2, 2), "fsdp"), ((2, 1, 2), "replicate")]


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sharded") / "checkpoint"


@pytest.fixture(scope="module")
def two_by_two(sharded_checkpoint: Path) -> list[dict[str, Any]]:
    """One spawn of 4 ranks for every 4-rank test (each spawn costs seconds), each worker
    on its own mesh in turn: per rank, each worker's result by name. The checkpoint is
    saved on (2, 2) and resumed on the other layouts in the same spawn."""
    calls = {
        "gathered": (mesh_workers.collectives, (False,)),
        "resharded": (mesh_workers.collectives, (True,)),
        "resharded_exact": (mesh_workers.gpt_exact, ((2, 2), RESHARDING, True)),
        "refusals": (mesh_workers.refusals, ()),
        "groups": (mesh_workers.groups_fsdp, ()),
        "auto_plan": (mesh_workers.auto_plan, ()),
        "one_stage": (mesh_workers.gpt_exact, ((1, 4), (("fsdp", "1f1b", "except_last"),))),
        "bytes": (mesh_workers.state_bytes, ()),
        "crossing": (mesh_workers.sharded_crossing, (("1f1b", "zb-h1"),)),
        "dropout": (mesh_workers.random_equal, ((2, 2), "zb-h1")),
        "shared": (mesh_workers.shared_blocks, (("1f1b", "zb-h1", "zb-v"),)),
        "habits": (mesh_workers.habits, ((2, 2),)),
        "habits_tp": (mesh_workers.habits, ((1, 2, 2),)),
        "saved": (mesh_workers.sharded_save, (str(sharded_checkpoint),)),
        "resumed": (mesh_workers.sharded_resumes, (str(sharded_checkpoint), CHECKPOINT_LAYOUTS)),
    }
    return [dict(zip(calls, results))
            for results in run_ranks(in_turn, 4, list(calls.values()), timeout=600)]


def test_each_unit_is_gathered_once_and_reduced_once_per_step(
        two_by_two: list[dict[str, Any]]) -> None:
    """Counted by the profiler: once per step even with every micro-batch recomputed;
    resharded after each forward, gathered for each forward and each backward."""
    for found in two_by_two:
        units, counted = found["gathered"]
        units_again, recounted = found["resharded"]
        assert units == units_again in (4, 5)  # a unit per layer: 5 on stage 0, 4 on stage 1
        assert counted == {"all_gather": units, "reduce_scatter": units}
        assert recounted == {"all_gather": 2 * CHUNKS * units, "reduce_scatter": units}


def test_resharding_after_each_forward_stays_exact(two_by_two: list[dict[str, Any]]) -> None:
    for found in two_by_two:
        for combination, loss_error, grad_error, _ in found["resharded_exact"]:
            assert loss_error < EXACT and grad_error < EXACT, combination


def test_mesh_options_it_cannot_honour_are_refused_by_name(
        two_by_two: list[dict[str, Any]]) -> None:
    for found in two_by_two:
        assert found["refusals"] == [
            "unknown data_parallel 'zero'; expected one of: replicate, fsdp",
            "reshard_after_forward=True applies to data_parallel='fsdp' only, got "
            "data_parallel='replicate'",
            "the mesh's 'tp' dimension is 2: pass tensor_parallel='auto', a dict of module names "
            "to styles, or fn(layer, tp_mesh) to say how each stage splits across it",
            "tensor_parallel= needs a mesh with a 'tp' dimension, got dimensions ('pp', 'dp')",
        ]


def test_fsdp_over_the_groups_of_make_groups(two_by_two: list[dict[str, Any]]) -> None:
    """Distributed(group, data_group=...) instead of a mesh: sharded and exact too."""
    for found in two_by_two:
        loss_error, grad_error, sharded = found["groups"]
        assert loss_error < EXACT and grad_error < EXACT and sharded > 0


def test_an_auto_plan_is_one_plan_for_every_replica_and_exact(
        two_by_two: list[dict[str, Any]]) -> None:
    """The sample on rank 0 only: the first rank of the mesh plans (replicas priced) and
    every rank runs that plan."""
    picks = {found["auto_plan"][0] for found in two_by_two}
    assert len(picks) == 1, picks
    for found in two_by_two:
        _, loss_error, grad_error = found["auto_plan"]
        assert loss_error < EXACT and grad_error < EXACT


def test_one_stage_over_four_replicas_is_exact_and_holds_a_quarter(
        two_by_two: list[dict[str, Any]]) -> None:
    """(pp, dp) = (1, 4): exact, and the bytes of parameters, gradients and Adam state a
    rank holds after a step under FSDP are a quarter of the replicated stage's."""
    parameters = len(zoo.per_layer_parameters(mesh_gpt()))
    for found in two_by_two:
        (_, loss_error, grad_error, compared), = found["one_stage"]
        held = found["bytes"]
        assert loss_error < EXACT and grad_error < EXACT
        assert compared == parameters  # every parameter on the one stage
        assert held["fsdp"] <= (0.25 + 0.05) * held["replicate"], held
        assert held["fsdp"] < 0.26 * held["replicate"], held


def test_a_dtensor_stage_output_crosses_as_its_shard_and_stays_exact(
        two_by_two: list[dict[str, Any]]) -> None:
    """A Colwise Linear with use_local_output=False ends stage 0, a Rowwise Linear starts
    stage 1 (tp = 2): each tensor-parallel rank sends its shard, the next reads it as its
    style's input layout. (Sent as a DTensor, the step fails inside the transport.)"""
    for found in two_by_two:
        assert max(found["crossing"]) < EXACT, found["crossing"]


def test_dropout_shared_blocks_accumulation_clipping_and_inference_under_fsdp(
        two_by_two: list[dict[str, Any]]) -> None:
    """On (2, 2) and on (1, 2, 2) with tensor parallelism: dropout under one seed gives the
    replicated pipeline's gradients; a block reused at several positions and a frozen
    layer stay exact; two steps without zero_grad, clip_grad_norm_, pipe(x) and
    gather_state_dict give the unpipelined model's (see ``habits``)."""
    gatherers = 0
    for results in two_by_two:
        dropout_difference, shared = results["dropout"], results["shared"]
        found_per_shape = [results["habits"], results["habits_tp"]]
        assert dropout_difference == 0.0
        # One block at three positions (two on one stage), a frozen layer: exact, and the
        # frozen layer gets no gradient.
        assert max(shared) < EXACT, shared
        # Half of the stage's elements over 2 replicas; over 2 replicas x 2 tensor-parallel
        # ranks a quarter, and a little more (norms and embeddings are whole on each).
        for found, held in zip(found_per_shape, ((0.45, 0.55), (0.25, 0.3))):
            assert found["accumulated"] < EXACT
            assert found["norm"] < EXACT and found["clipped"] < EXACT
            assert found["inference"] < EXACT
            assert found["gathered_after"] == 0  # a forward-only call frees what it gathered
            assert held[0] < found["held"] < held[1]
            if "gathered_state" in found:  # each pipeline's first rank: the whole model
                assert found["gathered_state"] == 0.0 and found["gathered_keys"] == 1.0
                gatherers += 1
    assert gatherers == 2 + 4  # (2, 2): 2 pipelines; (1, 2, 2): 4 pipelines of one stage


# -- a sharded checkpoint resumes on other layouts -------------------------------------------


def test_a_sharded_checkpoint_resumes_on_other_meshes_exactly(
        two_by_two: list[dict[str, Any]]) -> None:
    """Saved after 3 steps on (2, 2) under FSDP with Adam (every parameter sharded), loaded
    on (4, 1), (2, 2) and (2, 1, 2) with tensor parallelism, trained 3 more steps: the
    parameters of 6 uninterrupted plain steps."""
    for found in two_by_two:
        sharded, held = found["saved"]
        assert sharded == held > 0
        for (shape, _), (step, error, compared) in zip(CHECKPOINT_LAYOUTS, found["resumed"]):
            assert step == STEPS_BEFORE_SAVE
            assert error < EXACT and compared > 0, shape


def test_a_sharded_checkpoint_resumes_in_one_process_and_unpipelined(
        two_by_two: list[dict[str, Any]], sharded_checkpoint: Path) -> None:
    from pipeline import Pipe, load_checkpoint, load_into_model

    torch.set_num_threads(1)
    expected = reference_parameters(STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD)
    one_stage = Pipe(mesh_gpt(seed=99), CHUNKS, devices=["cpu"], loss_fn=zoo.gpt_loss())
    plain = mesh_gpt(seed=98)
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
