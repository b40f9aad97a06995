"""Multi-process Pipe beyond equivalence: failures, agreement, state, inference, clipping, DP.

Spawning ranks costs seconds (processes, torch's import, a process group), so the tests
share a spawn per world size where they can, each rank function in turn on the same group
(``two_ranks``, ``three_ranks``, ``four_ranks``): a function that breaks a pipeline on
purpose builds it on a fresh group, or goes last, as does one whose ranks must leave the
moment it returns. A rank that dies goes alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_harness import in_turn, run_ranks, run_ranks_raw
from dist_workers import (
    failed_profile_on_rank_zero,
    tied_on_meta,
    scaler_overflow,
    autocast_step,
    tied_weights,
    structured_payloads,
    timeline_after_close,
    silent_peer,
    clipping,
    data_parallel,
    mesh_data_parallel,
    deep_mlp,
    disagreement,
    failing_rank,
    meta_init,
    parameters_after_close,
    measured_memory,
    repeated_steps,
    state_and_inference,
    variable_lengths,
    wrong_stage_count,
)

TOLERANCE = 1e-10

Calls = dict[str, tuple[Any, tuple[Any, ...]]]


def _in_turn(world: int, calls: Calls, timeout: float = 300.0) -> list[dict[str, Any]]:
    """One spawn of ``world`` ranks running ``calls`` in turn: per rank, each result by name."""
    return [dict(zip(calls, results))
            for results in run_ranks(in_turn, world, list(calls.values()), timeout=timeout)]


@pytest.fixture(scope="module")
def saved_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gathered") / "checkpoint.pt"


@pytest.fixture(scope="module")
def two_ranks(saved_state: Path) -> list[dict[str, Any]]:
    return _in_turn(2, {
        "stage_count": (wrong_stage_count, ()),
        "state": (state_and_inference, (str(saved_state),)),
        "clipping": (clipping, (0.05,)),
        "variable_lengths": (variable_lengths, ()),
        "meta_init": (meta_init, ()),
        "repeated_steps": (repeated_steps, (("gpipe", "1f1b", "zb-v"),)),
        "measured_memory": (measured_memory, ()),
        "structured": (structured_payloads, ("gloo",)),
        "tied_weights": (tied_weights, ()),
        "autocast": (autocast_step, ()),
        "overflow": (scaler_overflow, ()),
        "tied_on_meta": (tied_on_meta, ()),
        "after_close": (parameters_after_close, ()),
        "failed_profile": (failed_profile_on_rank_zero, ()),  # fails on purpose
        # Silent for 9 s with a 3 s timeout, on a fresh group; its waiting rank must leave
        # the moment it returns: last.
        "silent_peer": (silent_peer, (9.0, 3.0)),
    })


@pytest.fixture(scope="module")
def three_ranks() -> tuple[list[int], list[dict[str, Any]], list[int]]:
    """The spawned children before, per rank each call's result, and the children after.
    Rank 1 of 3 raises mid-step on a fresh group (``failing_rank``) before the world group's
    last call."""
    before = _spawned_children()
    found = _in_turn(3, {
        "disagreement": (disagreement, ()),
        "failed_step": (failing_rank, (1, False)),
        "timeline_after_close": (timeline_after_close, ()),  # its ranks leave at once: last
    })
    return before, found, _spawned_children()


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return _in_turn(4, {
        "clipping": (clipping, (0.05,)),
        "data_parallel": (data_parallel, ()),
        "mesh_data_parallel": (mesh_data_parallel, ()),
        "structured": (structured_payloads, ("ordered",)),
    })


def _spawned_children() -> list[int]:
    """The rank processes ``run_ranks`` started for this process and left running: forked by
    its fork server (a child of this process), or spawned (``spawn_main``) where there is none;
    not the fork server itself, nor the resource tracker."""
    processes: dict[int, tuple[int, bytes]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        processes[int(entry)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmdline)
    servers = {pid for pid, (parent, cmdline) in processes.items()
               if parent == os.getpid() and b"forkserver" in cmdline}
    return [pid for pid, (parent, cmdline) in processes.items()
            if parent in servers or (parent == os.getpid() and b"spawn_main" in cmdline)]


def test_a_rank_that_raises_fails_every_rank_quickly_naming_it(
        three_ranks: tuple[list[int], list[dict[str, Any]], list[int]]) -> None:
    _, found, _ = three_ranks
    for rank in range(3):
        outcome, kind, message, seconds = found[rank]["failed_step"]
        assert outcome == "raised", f"rank {rank} finished a step in which rank 1 failed"
        assert seconds < 4.0, f"rank {rank} took {seconds:.1f}s: it waited for the timeout"
        if rank == 1:
            assert kind == "StageError" and "injected failure" in message
            assert "stage 1, layer 3 (RaiseAt), micro-batch" in message
        else:
            assert kind == "PeerError" and "rank 1 failed" in message
            assert "injected failure" in message


def test_a_dead_peer_is_an_error_within_the_timeout() -> None:
    results = run_ranks_raw(failing_rank, 2, 1, True, timeout=60)
    status, value = results[0]
    assert status == "ok", value
    outcome, kind, message, seconds = value
    assert outcome == "raised" and kind == "PeerError"
    assert "rank 1" in message
    assert seconds < 4.0 + 3.0
    assert results[1][0] == "error"  # it died without a word


def test_ranks_that_disagree_all_fail_naming_the_odd_one(
        three_ranks: tuple[list[int], list[dict[str, Any]], list[int]]) -> None:
    for found in three_ranks[1]:
        message = found["disagreement"]
        assert "rank 1 has balance=[4, 12]" in message
        assert "[8, 8]" in message


def test_stage_count_must_be_the_group_size(two_ranks: list[dict[str, Any]]) -> None:
    for found in two_ranks:
        messages = found["stage_count"]
        assert "expected 2, got 4" in messages[0]
        assert "schedule.stages=3" in messages[1] and "the group's size=2" in messages[1]


def test_gathered_state_loads_into_the_plain_model(
        two_ranks: list[dict[str, Any]], saved_state: Path) -> None:
    keys_0, no_output_on_first = two_ranks[0]["state"]
    keys_1, eval_error, training_error = two_ranks[1]["state"]
    assert no_output_on_first
    assert keys_0 and keys_1 and not set(keys_0) & set(keys_1)
    assert all(key.split(".")[0].isdigit() for key in keys_0 + keys_1)
    assert eval_error < TOLERANCE, "pipe(x) in eval mode must equal the plain model's output"
    assert training_error > 1e-3, "in training mode dropout is active, so outputs differ"
    assert sorted(torch.load(saved_state)) == sorted(keys_0 + keys_1)
    assert [p.name for p in saved_state.parent.iterdir()] == ["checkpoint.pt"], \
        "no temporary left behind"


def test_clip_grad_norm_matches_the_plain_model(
        two_ranks: list[dict[str, Any]], four_ranks: list[dict[str, Any]]) -> None:
    for ranks in (two_ranks, four_ranks):
        for norm_error, grad_error, compared in (found["clipping"] for found in ranks):
            assert norm_error < TOLERANCE
            assert grad_error < TOLERANCE and compared > 0


def test_two_stages_by_two_replicas_average_gradients(four_ranks: list[dict[str, Any]]) -> None:
    for found in four_ranks:
        loss_error, grad_error, compared, refused = found["data_parallel"]
        assert refused == ("pass one of distributed=, mesh= or group= (each says the whole "
                           "process layout), got distributed=, group=")
        assert loss_error < TOLERANCE
        assert grad_error < TOLERANCE and compared > 0


def test_a_pp_by_dp_device_mesh_pipelines_along_pp_and_averages_along_dp(
        four_ranks: list[dict[str, Any]]) -> None:
    for found in four_ranks:
        loss_error, grad_error, compared, stages = found["mesh_data_parallel"]
        assert stages == 2
        assert loss_error < TOLERANCE
        assert grad_error < TOLERANCE and compared > 0


def test_variable_sequence_lengths_train_exactly_and_reuse_buffers(
        two_ranks: list[dict[str, Any]]) -> None:
    results = [found["variable_lengths"] for found in two_ranks]
    for loss_error, grad_error, compared, allocations, output_error in results:
        assert loss_error < TOLERANCE and grad_error < TOLERANCE and compared > 0
        assert allocations[1] == allocations[0], "same shapes again: no new receive buffers"
    assert results[1][4] is not None and results[1][4] < TOLERANCE


def test_meta_model_materialises_only_local_layers(two_ranks: list[dict[str, Any]]) -> None:
    results = [found["meta_init"] for found in two_ranks]
    assert results[0][0] == ["0", "2", "4", "6"]
    assert results[1][0] == ["10", "12", "14", "8"]
    for _, grad_error, compared in results:
        assert grad_error < TOLERANCE and compared == 8


def test_no_process_outlives_a_failed_step(
        three_ranks: tuple[list[int], list[dict[str, Any]], list[int]]) -> None:
    before, found, after = three_ranks
    assert not before
    assert len(found) == 3 and all("failed_step" in results for results in found)
    assert not after


def test_memory_is_measured_on_each_rank_inside_measure_memory(
        two_ranks: list[dict[str, Any]]) -> None:
    for rank, found in enumerate(two_ranks):
        refused, measured, simulated = found["measured_memory"]
        assert "no step has run inside one" in refused, (rank, refused)
        assert measured == simulated, (rank, measured, simulated)
    assert [found["measured_memory"][1] for found in two_ranks] == [[2.0, 4.0], [1.0, 4.0]]


def test_repeated_steps_and_a_shape_change_stay_exact(two_ranks: list[dict[str, Any]]) -> None:
    # From the second step on, payload receives are posted ahead with last step's shapes;
    # several in flight must not share a buffer, and a changed shape must still arrive whole.
    for found in two_ranks:
        for schedule, error in found["repeated_steps"]:
            assert error < TOLERANCE, f"{schedule}: gradients off by {error}"


def test_a_silent_peer_ends_every_waiting_rank_within_the_timeout(
        two_ranks: list[dict[str, Any]]) -> None:
    # Silent for 9 s with a 3 s timeout: the waiting rank gives up some 6 s before the
    # silent one wakes, while a wait that lasted until then would take near 9 s, past 7.
    silent, waiting = [found["silent_peer"] for found in two_ranks]
    # The waiting rank had every message of the first step (the loss rides on them), so
    # that step is whole; the next one waits for the silent rank's first message (no
    # timeline is gathered between steps: issue 43), and gives up.
    assert waiting[0][0] == "finished", waiting
    assert waiting[1][0] == "PeerError" and waiting[1][1] < 7, waiting
    assert "within 3s" in waiting[1][2]
    # The silent rank wakes, finishes its step and finds its peer gone in the next one.
    assert silent[0][0] == "finished" and silent[0][1] >= 9.0, silent
    assert silent[1][0] == "PeerError" and silent[1][1] < 10, silent
    for steps in (silent, waiting):
        assert "cannot be reused" in steps[2][2] and "build a new one" in steps[2][2]


def test_the_last_timeline_survives_close_and_the_loss_is_everywhere(
        three_ranks: tuple[list[int], list[dict[str, Any]], list[int]]) -> None:
    # The timeline is gathered in the background; close() completes it, so rank 0 still
    # has every stage's events though the other ranks left the moment they closed.
    first, *others = [found["timeline_after_close"] for found in three_ranks[1]]
    losses, stages, count = first
    assert stages == [0, 1, 2] and count == 3 * 2 * 4
    for other_losses, nothing in others:
        assert nothing is None
        assert other_losses == losses  # every rank's loss, bit for bit


@pytest.mark.parametrize(("transport", "ranks"), [("gloo", "two_ranks"), ("ordered", "four_ranks")])
def test_structured_and_complex_payloads_and_input_gradients_across_ranks(
        transport: str, ranks: str, request: pytest.FixtureRequest) -> None:
    results = [found["structured"] for found in request.getfixturevalue(ranks)]
    for error, _, input_error, _ in results:
        assert error < TOLERANCE and input_error < TOLERANCE
    assert sum(compared for _, compared, _, _ in results) == 8  # every parameter, once
    assert results[0][2] is not None


def test_a_weight_tied_across_ranks_is_summed_clipped_once_and_saved_under_both_keys(
        two_ranks: list[dict[str, Any]]) -> None:
    results = [found["tied_weights"] for found in two_ranks]
    for grad_error_tied, norm_error, _ in results:
        assert grad_error_tied < TOLERANCE  # the full gradient on both ranks, after clipping too
        assert norm_error < TOLERANCE
    assert results[0][2] == ["0.weight", "1.weight", "3.weight", "4.weight"]


def test_autocast_around_step_and_forward_reaches_every_rank(
        two_ranks: list[dict[str, Any]]) -> None:
    (first_dtype, first_error), (last_dtype, last_error) = [found["autocast"] for found in two_ranks]
    assert first_dtype is None and last_dtype == torch.bfloat16
    assert first_error < 5e-2 and last_error < 5e-2  # bf16 tolerance, relative to the largest


def test_a_gradient_overflow_on_one_rank_makes_every_rank_skip_the_step(
        two_ranks: list[dict[str, Any]]) -> None:
    results = [found["overflow"] for found in two_ranks]
    assert [unchanged for unchanged, _ in results] == [True, True]
    assert results[0][1] == results[1][1] < 2.0**100


def test_tied_weights_on_the_meta_device_are_refused_not_untied(
        two_ranks: list[dict[str, Any]]) -> None:
    for found in two_ranks:
        assert "meta device with parameters shared across stages (0.weight)" in \
            found["tied_on_meta"]


def test_a_failed_profile_on_rank_zero_fails_every_rank_at_once(
        two_ranks: list[dict[str, Any]]) -> None:
    results = [found["failed_profile"] for found in two_ranks]
    assert results[0][0] != "built" and results[1][0] == "ValueError"
    assert "rank 0 failed in balance" in results[1][1]
    assert all(seconds < 15 for _, _, seconds in results)  # not the 20 s timeout, nor 30 min


def test_a_closed_pipe_reports_only_the_parameters_its_rank_held(
        two_ranks: list[dict[str, Any]]) -> None:
    counts = [found["after_close"] for found in two_ranks]
    assert [after for _, after in counts] == [before for before, _ in counts]
    assert sum(before for before, _ in counts) == sum(p.numel() for p in deep_mlp().parameters())
