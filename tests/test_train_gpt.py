"""examples/train_gpt.py on gloo ranks: a few float64 steps equal the unpipelined model's, one
stage per rank and in a (pp, dp, tp) = (2, 2, 2) mesh; a checkpoint of the mesh resumes on
one stage per rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Small enough for 8 processes on 2 cores: 2 stages of 2 layers, 2 heads for 2 tp ranks.
SMALL = ["--batch", "4", "--chunks", "2", "--seq", "16", "--dim", "16", "--layers", "2",
         "--heads", "2", "--float64", "--compare", "--backend", "gloo"]


def run_script(processes: int, arguments: list[str]) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node processes examples/train_gpt.py arguments``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(processes), "examples/train_gpt.py", *arguments]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done


def test_two_ranks_match_the_unpipelined_model_and_plot(tmp_path: Path) -> None:
    plot = tmp_path / "loss.png"
    done = run_script(2, ["--steps", "3", "--batch", "8", "--seq", "32", "--float64",
                          "--compare", "--backend", "gloo", "--plot", str(plot)])
    assert "compare: 3 steps equal the unpipelined model's to 1e-10" in done.stdout, done.stdout
    assert plot.is_file() and plot.stat().st_size > 10_000


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """Two steps on 8 ranks in a (2, 2, 2) mesh under FSDP, compared, then saved: the
    output and the checkpoint."""
    checkpoint = tmp_path_factory.mktemp("mesh") / "checkpoint"
    done = run_script(8, ["--mesh", "2,2,2", "--steps", "2", *SMALL, "--save", str(checkpoint)])
    return done.stdout, checkpoint


def test_a_2_2_2_mesh_matches_the_unpipelined_model(mesh_run: tuple[str, Path]) -> None:
    output, checkpoint = mesh_run
    assert "compare: 2 steps equal the unpipelined model's to 1e-10" in output, output
    # Each block's weights split over 2 replicas x 2 tp ranks: rank 0 holds under half.
    assert "mesh (pp, dp, tp) = (2, 2, 2), fsdp: rank 0 holds 2,584 of its stage's 8,352" \
        in output, output
    assert (checkpoint / ".metadata").is_file()


def test_the_mesh_checkpoint_resumes_on_one_stage_per_rank(mesh_run: tuple[str, Path]) -> None:
    _, checkpoint = mesh_run
    done = run_script(2, ["--steps", "3", *SMALL, "--resume", str(checkpoint)])
    assert "over 1 step from step 2" in done.stdout, done.stdout
    assert "compare: 1 step equals the unpipelined model's to 1e-10" in done.stdout, done.stdout
