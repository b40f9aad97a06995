"""Multi-process Pipe beyond equivalence: failures, agreement, state, inference, clipping, DP."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dist_harness import run_ranks, run_ranks_raw
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
    repeated_steps,
    state_and_inference,
    variable_lengths,
    wrong_stage_count,
)

TOLERANCE = 1e-10


def test_a_rank_that_raises_fails_every_rank_quickly_naming_it() -> None:
    results = run_ranks_raw(failing_rank, 3, 1, False, timeout=60)
    for rank in range(3):
        status, value = results[rank]
        assert status == "ok", value
        outcome, kind, message, seconds = value
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


def test_ranks_that_disagree_all_fail_naming_the_odd_one() -> None:
    messages = run_ranks(disagreement, 3)
    for message in messages:
        assert "rank 1 has balance=[4, 12]" in message
        assert "[8, 8]" in message


def test_stage_count_must_be_the_group_size() -> None:
    for messages in run_ranks(wrong_stage_count, 2):
        assert "expected 2, got 4" in messages[0]
        assert "schedule.stages=3" in messages[1] and "the group's size=2" in messages[1]


def test_gathered_state_loads_into_the_plain_model(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    results = run_ranks(state_and_inference, 2, str(path))
    keys_0, no_output_on_first = results[0]
    keys_1, eval_error, training_error = results[1]
    assert no_output_on_first
    assert keys_0 and keys_1 and not set(keys_0) & set(keys_1)
    assert all(key.split(".")[0].isdigit() for key in keys_0 + keys_1)
    assert eval_error < TOLERANCE, "pipe(x) in eval mode must equal the plain model's output"
    assert training_error > 1e-3, "in training mode dropout is active, so outputs differ"
    assert sorted(torch.load(path)) == sorted(keys_0 + keys_1)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"], "no temporary left behind"


def test_clip_grad_norm_matches_the_plain_model() -> None:
    for world in (2, 4):
        for norm_error, grad_error, compared in run_ranks(clipping, world, 0.05):
            assert norm_error < TOLERANCE
            assert grad_error < TOLERANCE and compared > 0


def test_two_stages_by_two_replicas_average_gradients() -> None:
    for loss_error, grad_error, compared, refused in run_ranks(data_parallel, 4):
        assert refused == "pass either distributed=Distributed(...) or group=, not both"
        assert loss_error < TOLERANCE
        assert grad_error < TOLERANCE and compared > 0


def test_a_pp_by_dp_device_mesh_pipelines_along_pp_and_averages_along_dp() -> None:
    for loss_error, grad_error, compared, stages in run_ranks(mesh_data_parallel, 4):
        assert stages == 2
        assert loss_error < TOLERANCE
        assert grad_error < TOLERANCE and compared > 0


def test_variable_sequence_lengths_train_exactly_and_reuse_buffers() -> None:
    results = run_ranks(variable_lengths, 2)
    for loss_error, grad_error, compared, allocations, output_error in results:
        assert loss_error < TOLERANCE and grad_error < TOLERANCE and compared > 0
        assert allocations[1] == allocations[0], "same shapes again: no new receive buffers"
    assert results[1][4] is not None and results[1][4] < TOLERANCE


def test_meta_model_materialises_only_local_layers() -> None:
    results = run_ranks(meta_init, 2)
    assert results[0][0] == ["0", "2", "4", "6"]
    assert results[1][0] == ["10", "12", "14", "8"]
    for _, grad_error, compared in results:
        assert grad_error < TOLERANCE and compared == 8


def _spawned_children() -> list[int]:
    """This process's children started by multiprocessing's spawn (not its resource tracker)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == os.getpid() and b"spawn_main" in cmdline:
            children.append(int(entry))
    return children


def test_no_process_outlives_a_failed_step() -> None:
    assert not _spawned_children()
    results = run_ranks_raw(failing_rank, 2, 1, False, timeout=60)
    assert all(status == "ok" for status, _ in results.values())
    assert not _spawned_children()


def test_repeated_steps_and_a_shape_change_stay_exact() -> None:
    # From the second step on, payload receives are posted ahead with last step's shapes;
    # several in flight must not share a buffer, and a changed shape must still arrive whole.
    for results in run_ranks(repeated_steps, 2, ("gpipe", "1f1b", "zb-v")):
        for schedule, error in results:
            assert error < TOLERANCE, f"{schedule}: gradients off by {error}"


def test_a_silent_peer_ends_every_waiting_rank_within_the_timeout() -> None:
    silent, waiting = run_ranks(silent_peer, 2, 12.0, timeout=90)
    # The waiting rank had every message of the first step (the loss rides on them), so
    # that step is whole; the next one waits for the first step's timeline, and gives up.
    assert waiting[0][0] == "finished", waiting
    assert waiting[1][0] == "PeerError" and waiting[1][1] < 10, waiting
    assert "did not complete within 5s" in waiting[1][2]
    # The silent rank wakes, finishes its step and finds its peer gone in the next one.
    assert silent[0][0] == "finished" and silent[0][1] >= 12.0, silent
    assert silent[1][0] == "PeerError" and silent[1][1] < 10, silent
    for steps in (silent, waiting):
        assert "cannot be reused" in steps[2][2] and "build a new one" in steps[2][2]


def test_the_last_timeline_survives_close_and_the_loss_is_everywhere() -> None:
    # The timeline is gathered in the background; close() completes it, so rank 0 still
    # has every stage's events though the other ranks left the moment they closed.
    first, *others = run_ranks(timeline_after_close, 3)
    losses, stages, count = first
    assert stages == [0, 1, 2] and count == 3 * 2 * 4
    for other_losses, nothing in others:
        assert nothing is None
        assert other_losses == losses  # every rank's loss, bit for bit


@pytest.mark.parametrize(("transport", "world"), [("gloo", 2), ("ordered", 4)])
def test_structured_and_complex_payloads_and_input_gradients_across_ranks(
        transport: str, world: int) -> None:
    results = run_ranks(structured_payloads, world, transport)
    for error, _, input_error, _ in results:
        assert error < TOLERANCE and input_error < TOLERANCE
    assert sum(compared for _, compared, _, _ in results) == 8  # every parameter, once
    assert results[0][2] is not None


def test_a_weight_tied_across_ranks_is_summed_clipped_once_and_saved_under_both_keys() -> None:
    results = run_ranks(tied_weights, 2)
    for grad_error_tied, norm_error, _ in results:
        assert grad_error_tied < TOLERANCE  # the full gradient on both ranks, after clipping too
        assert norm_error < TOLERANCE
    assert results[0][2] == ["0.weight", "1.weight", "3.weight", "4.weight"]


def test_autocast_around_step_and_forward_reaches_every_rank() -> None:
    (first_dtype, first_error), (last_dtype, last_error) = run_ranks(autocast_step, 2)
    assert first_dtype is None and last_dtype == torch.bfloat16
    assert first_error < 5e-2 and last_error < 5e-2  # bf16 tolerance, relative to the largest


def test_a_gradient_overflow_on_one_rank_makes_every_rank_skip_the_step() -> None:
    results = run_ranks(scaler_overflow, 2)
    assert [unchanged for unchanged, _ in results] == [True, True]
    assert results[0][1] == results[1][1] < 2.0**100


def test_tied_weights_on_the_meta_device_are_refused_not_untied() -> None:
    for message in run_ranks(tied_on_meta, 2):
        assert "meta device with parameters shared across stages (0.weight)" in message


def test_a_failed_profile_on_rank_zero_fails_every_rank_at_once() -> None:
    results = run_ranks(failed_profile_on_rank_zero, 2)
    assert results[0][0] != "built" and results[1][0] == "ValueError"
    assert "rank 0 failed in balance" in results[1][1]
    assert all(seconds < 15 for _, _, seconds in results)  # not the 20 s timeout, nor 30 min


def test_a_closed_pipe_reports_only_the_parameters_its_rank_held() -> None:
    counts = run_ranks(parameters_after_close, 2)
    assert [after for _, after in counts] == [before for before, _ in counts]
    assert sum(before for before, _ in counts) == sum(p.numel() for p in deep_mlp().parameters())
