"""The demo: schedules side by side, a step predicted before it runs, a real training run.

1. Generates GPipe and 1F1B timetables for 4 stages and 8 micro-batches, prints
   their bubble fractions and peak activations, and draws both timelines.
2. On 2 gloo ranks, asks ``Pipe.predict`` for the 1F1B step before running any,
   then runs steps and prints the measured bubble beside the predicted one.
3. Trains a small MLP for a few dozen steps on 2 CPU processes with 1F1B,
   launched by torchrun, and writes the measured-vs-predicted timeline.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from schedules import Timeline, get_schedule, plot_timeline, simulate  # noqa: E402

OUT = Path("out")
DEMO_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")


def schedules_figure(stages: int = 4, microbatches: int = 8,
                     names: Sequence[str] = DEMO_SCHEDULES) -> tuple[Figure, dict[str, Timeline]]:
    """The first picture: each schedule simulated (F=1, B=2, I=W=1 when split), a panel each.

    The panels share one time axis that runs to the longest makespan, so that every
    panel shows its schedule whole and their lengths compare by eye; a dotted line
    marks each schedule's own makespan.

    Args:
        stages: pipeline stages.
        microbatches: micro-batches per step.
        names: registered schedule names, one panel each, top to bottom.

    Returns:
        The figure (not saved) and each schedule's simulated Timeline, by name.
    """
    timelines = {name: simulate(get_schedule(name, stages, microbatches), forward=1,
                                backward=1, weight=1) for name in names}
    longest = max(timeline.makespan for timeline in timelines.values())
    figure, axes = plt.subplots(len(names), 1, figsize=(13, 2.1 * len(names)), sharex=True,
                                squeeze=False)
    for (name, timeline), axis in zip(timelines.items(), axes[:, 0]):
        plot_timeline(timeline, ax=axis, title=f"{name}, makespan {timeline.makespan:g}")
        axis.axvline(timeline.makespan, color="0.35", linestyle=":", linewidth=1.0)
        axis.set_xlabel("")
    # plot_timeline sets each panel's limit to its own makespan; on a shared axis the
    # last one drawn would cut the longer schedules off.
    axes[-1, 0].set_xlim(0, longest)
    axes[-1, 0].set_xlabel("time (F = 1)")
    figure.tight_layout()
    return figure, timelines


def compare_schedules(stages: int = 4, microbatches: int = 8) -> None:
    """Print each demo schedule's bubble, makespan and peak activations; draw them."""
    figure, timelines = schedules_figure(stages, microbatches)
    print(f"P={stages} stages, M={microbatches} micro-batches, F=1, B=2 (I=W=1 when split)")
    print(f"{'schedule':18} {'bubble':>7} {'makespan':>9}  peak activations per stage")
    for name, timeline in timelines.items():
        peaks = " ".join(f"{p:g}" for p in timeline.peak_activations)
        print(f"{name:18} {timeline.bubble_fraction:7.1%} {timeline.makespan:9.2f}  {peaks}")
    OUT.mkdir(exist_ok=True)
    figure.savefig(OUT / "schedules.png", dpi=100)
    plt.close(figure)
    print(f"wrote {OUT / 'schedules.png'}\n")


def predict_and_measure(rank: int, world: int, schedules: list[str], chunks: int = 8,
                        steps: int = 5) -> list[tuple[str, Any, Any]] | None:
    """On each of ``world`` gloo ranks (``pipeline.launching.run_ranks``): per schedule, the
    step predicted before any step ran, and the median-makespan measured step after one
    warm-up. Rank 0 returns ``[(schedule, predicted, measured)]``, the others None."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from examples.train_mlp import build_model, teacher_batch
    from pipeline import Pipe, keep_freed_pages

    keep_freed_pages()  # steady CPU step times: freed memory kept for the next allocation
    found = []
    for name in schedules:
        pipe = Pipe(build_model(256, 8), chunks=chunks, schedule=name, checkpoint="except_last",
                    loss_fn=nn.MSELoss(), group=dist.group.WORLD)
        batch, targets = teacher_batch(256, 256, 0)
        placement = pipe.schedule.placement
        x = batch if placement[0] == rank else None
        y = targets if placement[-1] == rank else None
        optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-3)
        predicted = pipe.predict(x, y, optimizer=optimizer)  # before any step
        measured: list[Timeline] = []
        for _ in range(steps + 1):
            pipe.step(x, y)
            optimizer.step()
            optimizer.zero_grad()
            if pipe.timeline is not None:  # the whole step's, on rank 0
                measured.append(pipe.timeline)
        pipe.close()
        if rank == 0:
            ordered = sorted(measured[1:], key=lambda timeline: timeline.makespan)
            found.append((name, predicted, ordered[len(ordered) // 2]))
    return found if rank == 0 else None


def predicted_bubble(schedule: str = "1f1b") -> None:
    from pipeline.launching import run_ranks

    predicted, measured = run_ranks(predict_and_measure, 2, [schedule])[0][0][1:]
    error = (predicted.bubble_fraction - measured.bubble_fraction) / measured.bubble_fraction
    print(f"{schedule} on 2 gloo ranks, 8 micro-batches, predicted before the first step:")
    print(f"  step:   predicted {predicted.makespan * 1e3:.1f} ms, measured "
          f"{measured.makespan * 1e3:.1f} ms (median of 5 steps)")
    print(f"  bubble: predicted {predicted.bubble_fraction:.1%}, measured "
          f"{measured.bubble_fraction:.1%} ({error:+.0%} relative)\n")


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
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples, for the ranks
    compare_schedules()
    predicted_bubble()
    sys.exit(train_two_processes())
