"""examples/train_gpt.py on gloo ranks: a few float64 steps equal the unpipelined model's, one
stage per rank and in a (pp, dp, tp) = (2, 2, 2) mesh; a checkpoint of the mesh resumes on
one stage per rank.

The two-rank run is the script under ``torchrun``, as users launch it. The mesh and the
resume run the same script, command line and ``torchrun``'s environment variables on ranks
forked from ``run_ranks``'s fork server, which has imported torch once: under ``torchrun``
each of the 8 fresh processes imports torch itself (seconds of CPU each on 2 cores).
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pipeline.helpers.dist_harness import free_port, run_ranks

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_gpt.py"
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


def script_rank(rank: int, world: int, arguments: list[str]) -> str:
    """One rank of ``examples/train_gpt.py arguments`` as ``torchrun`` would start it: the
    script as ``__main__`` with ``torchrun``'s variables, joining its own process group on
    a port rank 0 picked (every rank leaves the harness's group first). What it printed."""
    import torch.distributed as dist

    picked = [free_port() if rank == 0 else 0]
    dist.broadcast_object_list(picked, src=0)
    port = picked[0]
    dist.barrier()  # no rank still needs the harness's store, which rank 0 serves
    dist.destroy_process_group()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    sys.path.insert(0, str(SCRIPT.parent))  # as for a script: its directory first
    sys.argv = [str(SCRIPT), *arguments]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(str(SCRIPT), run_name="__main__")
    return printed.getvalue()


def run_forked(processes: int, arguments: list[str]) -> str:
    """``script_rank`` on ``processes`` forked ranks: what they printed, in rank order."""
    return "".join(run_ranks(script_rank, processes, arguments, timeout=240))


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
    output = run_forked(8, ["--mesh", "2,2,2", "--steps", "2", *SMALL, "--save", str(checkpoint)])
    return output, checkpoint


def test_a_2_2_2_mesh_matches_the_unpipelined_model(mesh_run: tuple[str, Path]) -> None:
    output, checkpoint = mesh_run
    assert "compare: 2 steps equal the unpipelined model's to 1e-10" in output, output
    # Each block's weights split over 2 replicas x 2 tp ranks: rank 0 holds under half.
    assert "mesh (pp, dp, tp) = (2, 2, 2), fsdp: rank 0 holds 2,584 of its stage's 8,352" \
        in output, output
    assert (checkpoint / ".metadata").is_file()


def test_the_mesh_checkpoint_resumes_on_one_stage_per_rank(mesh_run: tuple[str, Path]) -> None:
    _, checkpoint = mesh_run
    output = run_forked(2, ["--steps", "3", *SMALL, "--resume", str(checkpoint)])
    assert "over 1 step from step 2" in output, output
    assert "compare: 1 step equals the unpipelined model's to 1e-10" in output, output
