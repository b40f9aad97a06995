"""The demo: schedules side by side, then a real 2-process pipeline training run.

1. Generates GPipe and 1F1B timetables for 4 stages and 8 micro-batches, prints
   their bubble fractions and peak activations, and draws both timelines.
2. Trains a small MLP for a few dozen steps on 2 CPU processes with 1F1B,
   launched by torchrun, and writes the measured-vs-predicted timeline.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from schedules import get_schedule, plot_timeline, simulate  # noqa: E402

OUT = Path("out")


def compare_schedules(stages: int = 4, microbatches: int = 8) -> None:
    names = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"]
    figure, axes = plt.subplots(len(names), 1, figsize=(13, 2.1 * len(names)), sharex=True)
    print(f"P={stages} stages, M={microbatches} micro-batches, F=1, B=2 (I=W=1 when split)")
    print(f"{'schedule':18} {'bubble':>7} {'makespan':>9}  peak activations per stage")
    for name, axis in zip(names, axes):
        timeline = simulate(get_schedule(name, stages, microbatches), forward=1, backward=1,
                            weight=1)
        peaks = " ".join(f"{p:g}" for p in timeline.peak_activations)
        print(f"{name:18} {timeline.bubble_fraction:7.1%} {timeline.makespan:9.2f}  {peaks}")
        plot_timeline(timeline, ax=axis, title=name)
    figure.tight_layout()
    OUT.mkdir(exist_ok=True)
    figure.savefig(OUT / "schedules.png", dpi=100)
    print(f"wrote {OUT / 'schedules.png'}\n")


def train_two_processes() -> int:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--standalone", str(Path(__file__).with_name("train_mlp.py")),
        "--steps", "40", "--schedule", "1f1b", "--chunks", "8",
        "--plot", str(OUT / "measured_vs_predicted.png"),
    ]
    print("$ torchrun --nproc-per-node 2 examples/train_mlp.py --steps 40 --schedule 1f1b")
    return subprocess.call(command)


if __name__ == "__main__":
    compare_schedules()
    sys.exit(train_two_processes())
