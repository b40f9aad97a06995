"""Checkpoints are written atomically, and a writer killed mid-write leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from pipeline import save_state_dict

_KILLED_WRITER = textwrap.dedent("""
    import sys, time, torch
    from pipeline import save_state_dict

    class Slow:
        def __reduce__(self):
            print("writing", flush=True)
            time.sleep(60)
            return (int, (0,))

    save_state_dict({"weight": torch.zeros(4), "slow": Slow()}, sys.argv[1])
""")


def test_a_writer_killed_midway_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "model.pt"
    save_state_dict({"weight": torch.ones(2)}, target)
    writer = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(target)],
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    assert writer.stdout is not None and writer.stdout.readline().strip() == "writing"
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    assert len(list(tmp_path.glob(".model.pt.*.tmp"))) == 1  # what a killed writer leaves
    assert torch.equal(torch.load(target)["weight"], torch.ones(2))  # the old checkpoint is intact
    live = tmp_path / f".model.pt.{os.getpid()}.inflight.tmp"  # a writer still at work
    live.write_bytes(b"")
    save_state_dict({"weight": torch.full((2,), 3.0)}, target)
    assert sorted(p.name for p in tmp_path.glob(".model.pt.*.tmp")) == [live.name]
    assert torch.equal(torch.load(target)["weight"], torch.full((2,), 3.0))


def test_a_directory_or_an_unwritable_place_is_a_checkpoint_error(tmp_path: Path,
                                                                   monkeypatch) -> None:
    import pytest

    from pipeline import CheckpointError

    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    for place, message in [(tmp_path / "runs", r"is a directory: name a file in it"),
                           (".", r"'\.' is a directory"),
                           ("/proc/self/pipesched.pt", r"cannot write '/proc/self/pipesched\.pt': ")]:
        with pytest.raises(CheckpointError, match=message):
            save_state_dict({"weight": torch.ones(2)}, place)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["notes.txt", "runs"]
    save_state_dict({"weight": torch.ones(2)}, "runs/model.pt")  # a file in it: written
    assert (tmp_path / "runs" / "notes.txt").read_text() == "mine"
    assert torch.equal(torch.load(tmp_path / "runs" / "model.pt")["weight"], torch.ones(2))
