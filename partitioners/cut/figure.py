"""One figure for a cut: per-stage cost bars beside the uniform cut's, and both timelines."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from partitioners.cut.report import CutReport
from schedules import Event, Op, Timeline, plot_timeline
from schedules.plot import OP_COLOURS


def plot_cut(chosen: CutReport, uniform: CutReport, label: str, path: str | Path) -> Path:
    """Write the figure to ``path`` (format from its suffix, e.g. ``.png``) and return the path."""
    import matplotlib.pyplot as plt

    stages = len(chosen.stages)
    row = 0.45 * stages + 1.4
    figure, axes = plt.subplots(
        3, 1, figsize=(11, 3.2 + 2 * row), height_ratios=[3.2, row, row], constrained_layout=True
    )
    _stage_bars(axes[0], chosen, uniform, label)
    longest = max(chosen.step_time, uniform.step_time) * 1e3 or 1.0
    for ax, cut, name in ((axes[1], chosen, label), (axes[2], uniform, "uniform")):
        plot_timeline(_in_ms(cut), ax=ax, title=f"{name} {list(cut.balance)}, {cut.schedule}")
        ax.set_xlim(0, longest)
        ax.set_xlabel("time (ms)")
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return Path(path)


def _in_ms(cut: CutReport) -> Timeline:
    timeline = cut.timeline
    events = tuple(
        Event(e.stage, e.action, e.start * 1e3, e.end * 1e3) for e in timeline.events
    )
    bound = None if timeline.makespan_bound is None else timeline.makespan_bound * 1e3
    return replace(timeline, events=events, makespan_bound=bound)


def _stage_bars(ax: Any, chosen: CutReport, uniform: CutReport, label: str) -> None:
    width = 0.38
    bars = ((-width / 2, chosen, label, 1.0), (width / 2, uniform, "uniform", 0.45))
    for offset, cut, name, alpha in bars:
        positions = [index + offset for index in range(len(cut.stages))]
        forward = [stage.forward * 1e3 for stage in cut.stages]
        backward = [stage.backward * 1e3 for stage in cut.stages]
        ax.bar(positions, forward, width, color=OP_COLOURS[Op.F], alpha=alpha,
               label=f"{name}: forward", edgecolor="white")
        ax.bar(positions, backward, width, bottom=forward, color=OP_COLOURS[Op.B], alpha=alpha,
               label=f"{name}: backward", edgecolor="white")
        if any(stage.send_time for stage in cut.stages):
            below = [f + b for f, b in zip(forward, backward)]
            ax.bar(positions, [stage.send_time * 1e3 for stage in cut.stages], width,
                   bottom=below, color="#8C8C8C", alpha=alpha, label=f"{name}: send",
                   edgecolor="white")
        for position, stage in zip(positions, cut.stages):
            ax.text(position, stage.cost * 1e3, f"{stage.last - stage.first + 1}",
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(chosen.stages)))
    ax.set_xticklabels([f"stage {index}" for index in range(len(chosen.stages))])
    ax.set_ylabel("ms per micro-batch")
    ax.set_title(
        f"stage cost, {label} (imbalance {chosen.imbalance:.2f}) vs uniform "
        f"({uniform.imbalance:.2f}); numbers = layers per stage",
        fontsize=10,
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
