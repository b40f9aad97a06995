"""Checkpoints never delete what they did not write, and never read more than they hold
(issue 39): a save refuses a target holding anything but a checkpoint of ours, a file,
``"."``, a second saver and a place it cannot write, each a CheckpointError before a byte
is written; a load refuses symlinked files and sizes or offsets past the file's end before
anything is allocated, and everything it raises is a CheckpointError.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dist_harness import outcome, run_ranks
from pipeline import Pipe
from pipeline.saving.checkpoints import (
    INCOMPLETE_MARK,
    MANIFEST_FILE,
    METADATA_FILE,
    CheckpointError,
    check_complete,
    load_into_model,
    save_checkpoint,
    save_model_checkpoint,
)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3)).double()


def _trained() -> tuple[nn.Sequential, torch.optim.Optimizer]:
    """A model and an Adam that has state (so that the checkpoint holds optimizer tensors)."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
    optimizer.step()
    return model, optimizer


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (relative) and a file's bytes: what must stay untouched."""
    return {str(path.relative_to(root)): None if path.is_dir() else path.read_bytes()
            for path in sorted(root.rglob("*"))}


def _user_run(root: Path) -> Path:
    run = root / "runs" / "exp1"
    (run / "plots").mkdir(parents=True)
    (run / "notes.txt").write_text("lr 3e-4 diverged at step 900\n")
    (run / "plots" / "loss.png").write_bytes(b"\x89PNG not really")
    return run


# -- saving: nothing it did not write is removed or hidden -------------------------------------


def test_save_checkpoint_into_a_run_directory_of_the_users_leaves_its_files(
        tmp_path: Path) -> None:
    run = _user_run(tmp_path)
    before = _tree(tmp_path)
    pipe = Pipe(_model(), chunks=1, devices=["cpu", "cpu"], loss_fn=nn.MSELoss())
    with pytest.raises(CheckpointError, match=r"exp1 holds files that save_checkpoint did not "
                                              r"write: \['notes.txt', 'plots/'\]"):
        save_checkpoint(pipe, torch.optim.SGD(pipe.parameters(), lr=0.1), run, 1)
    pipe.close()
    with pytest.raises(CheckpointError, match=r"\['notes.txt', 'plots/'\]"):
        save_model_checkpoint(_model(), None, run, 1)
    assert _tree(tmp_path) == before  # nothing written, nothing beside it either
    save_model_checkpoint(_model(), None, run / "checkpoint", 1)  # the fix the message gives
    assert load_into_model(_model(), None, run / "checkpoint") == 1
    assert (run / "notes.txt").read_text().startswith("lr 3e-4")


def test_a_checkpoint_a_user_added_a_file_to_is_not_replaced(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    save_model_checkpoint(_model(), None, target, 1)
    (target / "README").write_text("the run that worked")
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError, match=r"\['README'\]"):
        save_model_checkpoint(_model(), None, target, 2)
    assert _tree(tmp_path) == before


def test_a_checkpoint_without_our_manifest_is_not_replaced(tmp_path: Path) -> None:
    target = tmp_path / "dcp"
    save_model_checkpoint(_model(), None, target, 1)
    (target / MANIFEST_FILE).unlink()  # as plain DCP or an earlier pipesched leaves one
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError, match=r"holds a checkpoint without \.checkpoint\.json"):
        save_model_checkpoint(_model(), None, target, 2)
    assert _tree(tmp_path) == before


def test_an_empty_directory_takes_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    save_model_checkpoint(_model(), None, tmp_path / "empty", 4)
    assert load_into_model(_model(), None, tmp_path / "empty") == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_a_save_onto_a_file_or_a_link_is_refused_and_hides_nothing(tmp_path: Path) -> None:
    (tmp_path / "weights.pt").write_bytes(b"the user's own weights")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "latest").symlink_to(tmp_path / "elsewhere")
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError, match=r"weights.pt is a file, not a checkpoint "
                                              r"directory"):
        save_model_checkpoint(_model(), None, tmp_path / "weights.pt", 1)
    with pytest.raises(CheckpointError, match=r"latest is a symbolic link"):
        save_model_checkpoint(_model(), None, tmp_path / "latest", 1)
    assert _tree(tmp_path) == before  # no .weights.pt.previous
    assert (tmp_path / "latest").is_symlink()


def test_saving_to_the_current_directory_or_above_it_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here = tmp_path / "runs" / "here"
    here.mkdir(parents=True)  # empty: refused for what it is, not for what it holds
    monkeypatch.chdir(here)
    for target in (".", "..", os.getcwd()):
        with pytest.raises(CheckpointError, match=r"the current directory"):
            save_model_checkpoint(_model(), None, target, 1)
    assert _tree(tmp_path) == {"runs": None, "runs/here": None}  # no ..partial anywhere
    save_model_checkpoint(_model(), None, "checkpoint", 1)  # a directory inside it is fine
    assert load_into_model(_model(), None, here / "checkpoint") == 1


@pytest.mark.parametrize("target", ["/proc/pipesched-checkpoint", "/sys/pipesched-checkpoint",
                                    "/proc/self/pipesched-checkpoint"])
def test_a_place_that_cannot_be_written_is_a_checkpoint_error(target: str) -> None:
    if not Path(target).parent.is_dir():
        pytest.skip(f"no {Path(target).parent} here")
    with pytest.raises(CheckpointError, match=rf"cannot write a checkpoint at {target}: "):
        save_model_checkpoint(_model(), None, target, 1)
    name = Path(target).name
    assert not (Path(target).parent / f".{name}.partial").exists()
    assert not (Path(target).parent / f".{name}.lock").exists()


def test_leftovers_of_a_killed_save_are_ours_to_clear_and_nothing_else(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    save_model_checkpoint(_model(), None, target, 1)
    staging, lock = tmp_path / ".ckpt.partial", tmp_path / ".ckpt.lock"
    staging.mkdir()  # as a save killed midway leaves them: the mark, a shard, its lock file
    (staging / INCOMPLETE_MARK).write_bytes(b"")
    (staging / "__0_0.distcp").write_bytes(b"half")
    lock.write_bytes(b"")
    save_model_checkpoint(_model(), None, target, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert load_into_model(_model(), None, target) == 2
    staging.mkdir()  # a directory of the user's that happens to have the name
    (staging / "draft.md").write_text("mine")
    with pytest.raises(CheckpointError, match=r"\.ckpt\.partial holds files that "
                                              r"save_checkpoint did not write: \['draft.md'\]"):
        save_model_checkpoint(_model(), None, target, 3)
    assert (staging / "draft.md").read_text() == "mine"
    assert load_into_model(_model(), None, target) == 2


def test_replacing_a_checkpoint_never_leaves_the_path_without_one(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    save_model_checkpoint(_model(), None, target, 0)
    seen: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                check_complete(target)
            except (CheckpointError, OSError) as error:
                seen.append(str(error))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for step in range(1, 13):
            save_model_checkpoint(_model(), None, target, step)
    finally:
        stop.set()
        watcher.join()
    assert seen == []
    assert load_into_model(_model(), None, target) == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# -- two processes saving to one path ---------------------------------------------------------


class _Gate(nn.Module):
    """A layer whose extra state is read at every save: ``wait`` holds the first save that
    reads it once its staging directory exists (midway, after the save took its path)."""

    def __init__(self, staging: Path | None = None,
                 wait: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.staging, self.wait = staging, wait

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def get_extra_state(self) -> torch.Tensor:
        if self.wait is not None and self.staging is not None and self.staging.exists():
            wait, self.wait = self.wait, None
            wait()
        return torch.zeros(1)

    def set_extra_state(self, state: Any) -> None:
        pass


def _gated(staging: Path | None = None, wait: Callable[[], None] | None = None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), _Gate(staging, wait)).double()


def _two_savers(rank: int, world: int, target: str) -> dict[str, Any]:
    """Rank 0 saves step 2 and is held midway; rank 1 saves step 3 to the same path then."""
    import torch.distributed as dist

    path = Path(target)
    if rank == 0:
        held = _gated(path.parent / f".{path.name}.partial",
                      lambda: (dist.barrier(), dist.barrier()))
        save_model_checkpoint(held, None, path, 2)
        dist.barrier()
        return {}
    dist.barrier()  # rank 0 is midway through its save
    said, _ = outcome(lambda: save_model_checkpoint(_gated(), None, path, 3))
    during = load_into_model(_gated(), None, path)
    dist.barrier()  # let it finish
    dist.barrier()
    return {"said": said, "during": during, "after": load_into_model(_gated(), None, path),
            "left": sorted(os.listdir(path.parent))}


def test_a_second_process_saving_to_the_same_path_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    save_model_checkpoint(_gated(), None, target, 1)
    second = run_ranks(_two_savers, 2, str(target), timeout=120)[1]
    assert second["said"].startswith("CheckpointError: another save to "), second["said"]
    assert "is in progress" in second["said"], second["said"]
    assert second["during"] == 1  # the path held the previous checkpoint meanwhile
    assert second["after"] == 2 and second["left"] == ["ckpt"]


def test_a_file_written_into_the_target_during_a_save_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    save_model_checkpoint(_gated(), None, target, 1)
    notes = target / "notes.txt"
    during = _gated(tmp_path / ".ckpt.partial", lambda: notes.write_text("written meanwhile"))
    with pytest.raises(CheckpointError, match=r"ckpt holds files that save_checkpoint did not "
                                              r"write: \['notes.txt'\]"):
        save_model_checkpoint(during, None, target, 2)
    assert notes.read_text() == "written meanwhile"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert load_into_model(_gated(), None, target) == 1


# -- loading: symlinks, claimed sizes, and nothing but CheckpointError -------------------------


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model, optimizer = _trained()
    save_model_checkpoint(model, optimizer, tmp_path / "ckpt", 1)
    return tmp_path / "ckpt"


def _load(path: Path) -> int:
    model = _model()
    return load_into_model(model, torch.optim.Adam(model.parameters()), path)


@pytest.mark.parametrize("name", ["__0_0.distcp", METADATA_FILE, MANIFEST_FILE])
def test_a_file_replaced_by_a_symlink_is_refused(saved: Path, tmp_path: Path,
                                                 name: str) -> None:
    outside = tmp_path / "outside"
    (saved / name).rename(outside)  # the very bytes that were saved, reached through a link
    (saved / name).symlink_to(outside)
    with pytest.raises(CheckpointError, match=rf"{saved / name} is a symbolic link"):
        _load(saved)
    (saved / name).unlink()
    outside.rename(saved / name)
    assert _load(saved) == 1


def test_a_checkpoint_reached_through_a_linked_directory_loads(saved: Path,
                                                               tmp_path: Path) -> None:
    (tmp_path / "latest").symlink_to(saved)  # the usual "latest -> step-1000"
    assert _load(tmp_path / "latest") == 1


def _rewrite_manifest(directory: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Change the manifest's body and sign it again, as whoever writes the directory can."""
    manifest = directory / MANIFEST_FILE
    document = json.loads(manifest.read_text())
    change(document["body"])
    canonical = json.dumps(document["body"], sort_keys=True, separators=(",", ":")).encode()
    document["sha256"] = hashlib.sha256(canonical).hexdigest()
    manifest.write_text(json.dumps(document))


def _storage(body: dict[str, Any], fqn: str) -> dict[str, Any]:
    entry = next(e for e in body["metadata"]["storage"] if e["index"]["fqn"] == fqn)
    storage: dict[str, Any] = entry["storage"]
    return storage


@pytest.mark.parametrize("field, value", [("at", 2 ** 60), ("length", 2 ** 40),
                                          ("at", 2 ** 62 - 1)])
def test_an_offset_or_length_past_the_files_end_is_refused(saved: Path, field: str,
                                                           value: int) -> None:
    _rewrite_manifest(saved, lambda body: _storage(body, "model.0.weight").update({field: value}))
    with pytest.raises(CheckpointError, match=r"model\.0\.weight .*__0_0\.distcp.* past its end "
                                              r"\(\d+ bytes\)"):
        _load(saved)


def _claim(body: dict[str, Any], key: str, size: list[int]) -> None:
    entry = body["metadata"]["entries"][key]
    entry["size"] = size
    entry["chunks"] = [{"offsets": [0] * len(size), "sizes": size}]
    for stored in body["metadata"]["storage"]:
        if stored["index"]["fqn"] == key:
            stored["index"]["offset"] = [0] * len(size)


def test_a_claimed_tensor_larger_than_its_bytes_is_refused_before_allocating(
        saved: Path) -> None:
    key = "optim.state.0.weight.exp_avg"  # read into a placeholder of the claimed size
    _rewrite_manifest(saved, lambda body: _claim(body, key, [2 ** 20, 2 ** 20]))
    with pytest.raises(CheckpointError, match=rf"{key} claims 8796093022208 bytes "
                                              r"\(float64 \[1048576, 1048576\]\), more than "
                                              r"the \d+ bytes stored for it"):
        _load(saved)


def test_a_chunk_outside_its_tensor_is_refused(saved: Path) -> None:
    def outside(body: dict[str, Any]) -> None:
        body["metadata"]["entries"]["model.0.bias"]["chunks"][0]["offsets"] = [2 ** 40]

    _rewrite_manifest(saved, outside)
    with pytest.raises(CheckpointError, match=r"model\.0\.bias.*chunks\[0\]: expected a chunk "
                                              r"inside the tensor's size \[3\]"):
        _load(saved)


def test_everything_a_load_raises_is_a_checkpoint_error(saved: Path, tmp_path: Path) -> None:
    def refused(path: Path, pattern: str) -> None:
        with pytest.raises(CheckpointError, match=pattern) as caught:
            _load(path)
        assert type(caught.value) is CheckpointError, repr(caught.value)

    refused(tmp_path / "never-written", r"no checkpoint at .*never-written")
    (tmp_path / "weights.pt").write_bytes(b"")
    refused(tmp_path / "weights.pt", r"is not a checkpoint directory")
    shard = saved / "__0_0.distcp"
    kept = shard.read_bytes()
    shard.unlink()
    shard.mkdir()
    refused(saved, r"__0_0\.distcp is a directory, not a file of the checkpoint")
    shard.rmdir()
    os.mkfifo(shard)  # a read would wait forever
    refused(saved, r"__0_0\.distcp is a FIFO, not a file of the checkpoint")
    shard.unlink()
    shard.write_bytes(kept)
    foreign = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match=r"holds 4 parameter\(s\) that this rank's layers"):
        load_into_model(_model(), foreign, saved)
    assert _load(saved) == 1
