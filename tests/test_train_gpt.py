"""examples/train_gpt.py on 2 gloo ranks: a few float64 steps equal the unpipelined model's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_two_ranks_match_the_unpipelined_model_and_plot(tmp_path: Path) -> None:
    plot = tmp_path / "loss.png"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "examples/train_gpt.py", "--steps", "3", "--batch", "8", "--seq", "32",
        "--float64", "--compare", "--plot", str(plot),
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "compare: 3 steps equal the unpipelined model's to 1e-10" in done.stdout, output[-4000:]
    assert plot.is_file() and plot.stat().st_size > 10_000
