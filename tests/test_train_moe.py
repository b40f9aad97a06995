"""examples/train_moe.py: a Hugging Face Qwen2-MoE (a shared expert beside the routed ones)
trained as it is written at (pp=2, ep=2) under ZB-V; its float64 steps equal the plain
model's, by the model's own names, AdamW's second step too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_train_hf import _errors

ROOT = Path(__file__).resolve().parent.parent


def test_four_ranks_spread_the_experts_and_train_the_model_as_written_exactly() -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "4", "examples/train_moe.py", "--model", "qwen2-moe",
               "--schedule", "zb-v", "--steps", "2", "--layers", "2", "--float64", "--compare"]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    errors = _errors(done.stdout)
    assert len(errors) == 8  # 2 steps x 4 ranks
    assert all(loss < 1e-10 and grad < 1e-10 for loss, grad in errors)
