"""Checkpoints reshard: saved by 2 ranks, resumed on 4 ranks, on 3 threads, or unpipelined.

The truth is the unpipelined model trained without interruption: a pipeline saved after
3 steps and resumed for 3 more on another cut must end where 6 plain steps end, for Adam
and for SGD with momentum (whose state a local parameter order would scramble).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from checkpoint_workers import (
    CHUNKS,
    OPTIMIZERS,
    STEPS_AFTER_LOAD,
    STEPS_BEFORE_SAVE,
    batch,
    named_parameters,
    optimizer_state,
    reference_run,
    resume_and_train,
    train_and_save,
    train_pipe,
)
from dist_harness import in_turn, run_ranks
from dist_workers import deep_mlp
from pipeline import Pipe
from pipeline.saving.checkpoints import (
    INCOMPLETE_MARK,
    METADATA_FILE,
    CheckpointError,
    load_checkpoint,
    load_into_model,
    save_checkpoint,
)

TOLERANCE = 1e-10


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Checkpoints written by 2 ranks (one per optimizer), and what each rank saved."""
    directory = tmp_path_factory.mktemp("checkpoints")
    return directory, [_tensors(result) for result in run_ranks(train_and_save, 2, str(directory))]


@pytest.fixture(scope="module")
def four_ranks(saved: tuple[Path, list[dict[str, Any]]],
               tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[Any], Path]:
    """One spawn of 4 ranks for both 4-rank tests (each spawn costs seconds), in turn: the
    2-rank checkpoint resumed and trained on, then (pp, dp) = (2, 2) replicas saving one
    checkpoint. Per rank, each result; and where the replicas saved."""
    from checkpoint_workers import mesh_train_and_save

    directory, _ = saved
    replicated = tmp_path_factory.mktemp("replicated") / "dp"
    calls = [(resume_and_train, (str(directory),)), (mesh_train_and_save, (str(replicated),))]
    per_rank = [[_tensors(result) for result in results]
                for results in run_ranks(in_turn, 4, calls)]
    return [resumed for resumed, _ in per_rank], [held for _, held in per_rank], replicated


def _tensors(tree: Any) -> Any:
    """A rank's result with its numpy arrays as tensors again."""
    if isinstance(tree, dict):
        return {key: _tensors(value) for key, value in tree.items()}
    return torch.from_numpy(tree) if isinstance(tree, np.ndarray) else tree


def _merged(per_rank: list[dict[str, Any]], name: str, part: str) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for result in per_rank:
        merged.update(result[name][part])
    return merged


def _worst(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert sorted(actual) == sorted(expected)
    return max((actual[key] - expected[key]).abs().max().item() for key in expected)


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_the_two_ranks_saved_what_the_plain_model_holds(
        saved: tuple[Path, list[dict[str, Any]]], optimizer_name: str) -> None:
    _, per_rank = saved
    model, _ = reference_run(optimizer_name, STEPS_BEFORE_SAVE)
    assert _worst(_merged(per_rank, optimizer_name, "parameters"),
                  named_parameters(model)) < TOLERANCE


def test_a_two_rank_checkpoint_resumes_on_four_ranks(
        saved: tuple[Path, list[dict[str, Any]]],
        four_ranks: tuple[list[Any], list[Any], Path]) -> None:
    _, per_rank_saved = saved
    resumed, _, _ = four_ranks
    for name in OPTIMIZERS:
        model, _ = reference_run(name, STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD)
        assert [result[name]["step"] for result in resumed] == [STEPS_BEFORE_SAVE] * 4
        assert _worst(_merged(resumed, name, "parameters"), named_parameters(model)) < TOLERANCE
        # Ranks 0 and 1 take their own generator state; ranks the save did not have, rank 0's.
        for rank, result in enumerate(resumed):
            source = rank if rank < len(per_rank_saved) else 0
            assert torch.equal(result[name]["rng"], per_rank_saved[source][name]["rng"])


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_a_two_rank_checkpoint_resumes_in_one_process_on_three_stages(
        saved: tuple[Path, list[dict[str, Any]]], optimizer_name: str) -> None:
    directory, _ = saved
    torch.set_num_threads(1)
    pipe = Pipe(deep_mlp(), chunks=CHUNKS, devices=["cpu"] * 3, loss_fn=nn.MSELoss())
    optimizer = OPTIMIZERS[optimizer_name](pipe.parameters())
    step = load_checkpoint(pipe, optimizer, directory / optimizer_name)
    assert step == STEPS_BEFORE_SAVE
    train_pipe(pipe, optimizer, range(step, step + STEPS_AFTER_LOAD))
    model, _ = reference_run(optimizer_name, STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD)
    assert _worst(named_parameters(pipe.model), named_parameters(model)) < TOLERANCE
    pipe.close()


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_the_unpipelined_model_loads_a_two_rank_checkpoint_exactly(
        saved: tuple[Path, list[dict[str, Any]]], optimizer_name: str) -> None:
    directory, per_rank = saved
    model = deep_mlp()
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    optimizer.param_groups[0]["lr"] = 123.0  # the checkpoint's hyperparameters win
    assert load_into_model(model, optimizer, directory / optimizer_name) == STEPS_BEFORE_SAVE
    expected_parameters = _merged(per_rank, optimizer_name, "parameters")
    expected_state = _merged(per_rank, optimizer_name, "optimizer")
    actual_state = optimizer_state(model, optimizer)
    assert sorted(named_parameters(model)) == sorted(expected_parameters)
    for key, value in named_parameters(model).items():
        assert torch.equal(value, expected_parameters[key]), key
    assert sorted(actual_state) == sorted(expected_state) and expected_state
    for key, value in actual_state.items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(expected_state[key])), key
    assert optimizer.param_groups[0]["lr"] == OPTIMIZERS[optimizer_name]([
        torch.zeros(1, requires_grad=True)]).param_groups[0]["lr"]
    # And the plain model trains on to where 6 uninterrupted steps end.
    reference, _ = reference_run(optimizer_name, STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD)
    for step in range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD):
        x, y = batch(seed=step)
        optimizer.zero_grad()
        nn.MSELoss()(model(x), y).backward()
        optimizer.step()
    assert _worst(named_parameters(model), named_parameters(reference)) < TOLERANCE


def test_an_optimizer_of_another_kind_is_refused(
        saved: tuple[Path, list[dict[str, Any]]]) -> None:
    directory, _ = saved
    model = deep_mlp()
    with pytest.raises(CheckpointError, match=r"another kind of optimizer than this Adam: for "
                       r"0\.weight, keys missing \['amsgrad', 'betas', .*unexpected \['dampening', "
                       r"'momentum', 'momentum_buffer', 'nesterov'\]"):
        load_into_model(model, torch.optim.Adam(model.parameters()), directory / "sgd")


# -- interrupted saves -----------------------------------------------------------------------


def _local_pipe() -> tuple[Pipe, torch.optim.Optimizer]:
    pipe = Pipe(deep_mlp(), chunks=CHUNKS, devices=["cpu", "cpu"], loss_fn=nn.MSELoss())
    return pipe, OPTIMIZERS["adam"](pipe.parameters())


def _staging(target: Path) -> Path:
    return target.parent / f".{target.name}.partial"


def test_a_save_interrupted_before_the_rename_leaves_the_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.saving.checkpoints as checkpoints

    target = tmp_path / "run"
    pipe, optimizer = _local_pipe()
    train_pipe(pipe, optimizer, range(1))
    save_checkpoint(pipe, optimizer, target, 1)
    kept = named_parameters(pipe.model)
    train_pipe(pipe, optimizer, range(1, 2))

    def killed(staging: Path, target: Path) -> None:
        raise KeyboardInterrupt("killed after writing, before publishing")

    monkeypatch.setattr(checkpoints, "_publish", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(pipe, optimizer, target, 2)
    monkeypatch.undo()
    staging = _staging(target)
    assert (staging / METADATA_FILE).is_file() and (staging / INCOMPLETE_MARK).exists()
    with pytest.raises(ValueError, match="marked as being written"):
        load_checkpoint(pipe, optimizer, staging)
    fresh, fresh_optimizer = _local_pipe()
    assert load_checkpoint(fresh, fresh_optimizer, target) == 1
    assert _worst(named_parameters(fresh.model), kept) == 0.0
    save_checkpoint(pipe, optimizer, target, 2)  # the next save clears what was left
    assert not staging.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert load_checkpoint(fresh, fresh_optimizer, target) == 2


_KILLED_SAVER = textwrap.dedent("""
    import sys, time
    import torch
    from torch import nn
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from pipeline import Pipe
    from pipeline.saving.checkpoints import save_checkpoint

    def finish_slowly(self, metadata, results):  # .metadata is written here, last
        print("writing", flush=True)
        time.sleep(60)

    FileSystemWriter.finish = finish_slowly
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3)).double()
    pipe = Pipe(model, chunks=1, devices=["cpu", "cpu"], loss_fn=nn.MSELoss())
    save_checkpoint(pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), sys.argv[1], 7)
""")


def test_a_saver_killed_midway_leaves_a_directory_that_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "run"
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3)).double()
    pipe = Pipe(model, chunks=1, devices=["cpu", "cpu"], loss_fn=nn.MSELoss())
    save_checkpoint(pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), target, 5)
    saver = subprocess.Popen([sys.executable, "-c", _KILLED_SAVER, str(target)],
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    try:
        assert saver.stdout is not None and saver.stdout.readline().strip() == "writing"
    finally:
        os.kill(saver.pid, signal.SIGKILL)  # midway, or whatever happened: never left behind
        saver.wait()
    staging = _staging(target)
    assert any(staging.glob("*.distcp")) and not (staging / METADATA_FILE).exists()
    (staging / INCOMPLETE_MARK).unlink()  # even without the mark: no .metadata, no load
    with pytest.raises(ValueError, match=r"no \.metadata file"):
        load_into_model(model, None, staging)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_into_model(model, None, tmp_path / "never-written")
    assert load_into_model(model, torch.optim.SGD(model.parameters(), lr=0.1), target) == 5


def test_data_parallel_replicas_save_one_checkpoint_the_plain_model_loads(
        four_ranks: tuple[list[Any], list[Any], Path]) -> None:
    _, held, replicated = four_ranks
    model = deep_mlp()
    optimizer = OPTIMIZERS["adam"](model.parameters())
    for step in range(STEPS_BEFORE_SAVE):  # the replicas' average: the plain model on both
        x = torch.cat([batch(seed=100 * replica + step)[0] for replica in range(2)])
        y = torch.cat([batch(seed=100 * replica + step)[1] for replica in range(2)])
        optimizer.zero_grad()
        nn.MSELoss()(model(x), y).backward()
        optimizer.step()
    expected = named_parameters(model)
    loaded = deep_mlp()
    loaded_optimizer = OPTIMIZERS["adam"](loaded.parameters())
    assert load_into_model(loaded, loaded_optimizer, replicated) == STEPS_BEFORE_SAVE
    assert _worst(named_parameters(loaded), expected) < TOLERANCE
    assert _worst(optimizer_state(loaded, loaded_optimizer), optimizer_state(model, optimizer)) \
        < TOLERANCE
    for rank_held in held:  # every rank held its stage's share of the same parameters
        assert _worst(rank_held, {k: expected[k] for k in rank_held}) < TOLERANCE
