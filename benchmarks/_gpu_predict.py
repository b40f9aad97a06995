"""Part 5 of gpu_check.py: the step ``Pipe.predict`` foresees against the step measured.

One process, two stages (``cuda:0`` and ``cuda:1`` where there are two GPUs, else both
on ``cuda:0``), the GPT of the bf16 part in float32, a few schedules: per schedule the
prediction before any step, the median measured makespan after the warm-up, and the
prediction refined from those steps (issue 12's bar: within 10% of the measured
makespan). The figures are facts for the note, not a verdict on correctness: a miss is
printed, not counted as a FAIL; an exception is a FAIL.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

SCHEDULES = ("1f1b", "zb-h1", "interleaved-1f1b")
BAR = 0.10


def stage_devices(dry: bool) -> list[str]:
    """Two stages: on two GPUs where there are, else both on the first (or the CPU)."""
    if dry:
        return ["cpu", "cpu"]
    return ["cuda:0", "cuda:1"] if torch.cuda.device_count() >= 2 else ["cuda:0", "cuda:0"]


def predicted_against_measured(report: Any, make_model: Any, batch: tuple[Any, Any],
                               loss_fn: Any, chunks: int, devices: list[str], warmup: int,
                               steps: int) -> None:
    """Print, per schedule, predicted (before, refined) and measured makespan and bubble."""
    from pipeline import Pipe

    x, y = (t.to(devices[0]) for t in batch)
    report.line("predict", f"{len(devices)} stages on {devices}, M={chunks}, float32, "
                           f"{warmup} warm-up + {steps} measured steps; bar: within "
                           f"{BAR:.0%} of the measured makespan")
    if devices[0] == devices[1] and devices[0].startswith("cuda"):
        report.line("predict", "both stages share one GPU: their kernels contend for it, "
                               "while the simulator gives each stage a device of its own, so "
                               "expect the measured step above the prediction")
    for name in SCHEDULES:
        with Pipe(make_model(), chunks=chunks, devices=devices, schedule=name,
                  loss_fn=loss_fn) as pipe:
            before = pipe.predict(x, y)
            measured = []
            for index in range(warmup + steps):
                pipe.zero_grad(set_to_none=True)
                pipe.step(x, y)
                if index >= warmup:
                    measured.append(pipe.timeline)
            refined = pipe.predict(x, y)
        step = sorted(measured, key=lambda timeline: timeline.makespan)[len(measured) // 2]
        errors = [(p.makespan - step.makespan) / step.makespan for p in (before, refined)]
        within = "yes" if abs(errors[0]) <= BAR else "no"
        report.line("predict", f"{name:<17} measured {step.makespan * 1e3:8.2f} ms "
                               f"(spread {_spread(measured)}), predicted "
                               f"{before.makespan * 1e3:8.2f} ms ({errors[0]:+.1%}), refined "
                               f"{refined.makespan * 1e3:8.2f} ms ({errors[1]:+.1%}); bubble "
                               f"measured {step.bubble_fraction:.1%}, predicted "
                               f"{before.bubble_fraction:.1%}; within the bar: {within}")


def _spread(timelines: list[Any]) -> str:
    """The fastest and slowest measured makespans over the median, e.g. ``0.97-1.05x``."""
    spans = [timeline.makespan for timeline in timelines]
    middle = statistics.median(spans)
    return f"{min(spans) / middle:.2f}-{max(spans) / middle:.2f}x"
