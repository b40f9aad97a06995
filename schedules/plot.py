"""Draw a Timeline as a Gantt chart: one row per stage, a box per action, gaps are bubbles."""

from __future__ import annotations

from typing import Any

from schedules.action import Op
from schedules.timeline import Timeline

OP_COLOURS = {
    Op.F: "#4C72B0",  # blue
    Op.B: "#55A868",  # green
    Op.I: "#DD8452",  # orange
    Op.W: "#8172B3",  # purple
}
OP_LABELS = {
    Op.F: "forward",
    Op.B: "backward",
    Op.I: "input grad",
    Op.W: "weight grad",
}


def plot_timeline(timeline: Timeline, ax: Any = None, title: str | None = None) -> Any:
    """Draw ``timeline`` on ``ax`` (a new figure if None) and return the Axes.

    Stage 0 is the top row. Each action is a box coloured by its op with its
    micro-batch number inside (and the chunk, ``3/1``, when a stage holds several
    chunks); lighter shades mark later chunks. Idle time is left empty. The title
    gives the bubble fraction and, for a simulated timeline, its lower bound.

    Args:
        timeline: a simulated or measured Timeline.
        ax: a matplotlib Axes to draw on, or None for a new figure.
        title: replaces the default title (the timeline's name).

    Returns:
        The matplotlib Axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Patch

    if ax is None:
        width = min(24.0, 6.0 + 0.12 * len(timeline.events) / max(timeline.stages, 1))
        _, ax = plt.subplots(figsize=(width, 0.45 * timeline.stages + 1.6))
    origin = timeline.start
    makespan = timeline.makespan or 1.0
    axis_width_pixels = ax.get_window_extent().width or 600.0
    multi_chunk = max(timeline.chunks_per_stage) > 1
    for event in timeline.events:
        action = event.action
        left = event.start - origin
        rank = timeline.stages - 1 - event.stage
        local = 0
        if multi_chunk:
            chunks = sorted({e.action.chunk for e in timeline.events if e.stage == event.stage})
            local = chunks.index(action.chunk)
        colour = to_rgba(OP_COLOURS[action.op], alpha=1.0 - 0.35 * min(local, 2) / 2)
        ax.barh(rank, event.duration, left=left, height=0.8, color=colour,
                edgecolor="white", linewidth=0.5)
        label = f"{action.microbatch}/{action.chunk}" if multi_chunk else f"{action.microbatch}"
        box_pixels = axis_width_pixels * event.duration / makespan
        fontsize = min(9.0, box_pixels / (0.62 * len(label) + 0.4))
        if fontsize >= 4.0:
            ax.text(left + event.duration / 2, rank, label, ha="center", va="center",
                    fontsize=fontsize, color="white")
    ax.set_yticks(range(timeline.stages))
    ax.set_yticklabels([f"stage {s}" for s in reversed(range(timeline.stages))])
    ax.set_xlim(0, makespan)
    ax.set_ylim(-0.6, timeline.stages - 0.4)
    ax.set_xlabel("time")
    ops = sorted({e.action.op for e in timeline.events}, key=lambda op: list(Op).index(op))
    ax.legend(
        handles=[Patch(color=OP_COLOURS[op], label=OP_LABELS[op]) for op in ops],
        loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False,
    )
    heading = title if title is not None else (timeline.name or "pipeline timeline")
    detail = f"bubble {timeline.bubble_fraction:.1%}"
    if timeline.bubble_bound is not None:
        detail += f" (lower bound {max(timeline.bubble_bound, 0.0):.1%})"
    ax.set_title(f"{heading}: {detail}", fontsize=10)
    return ax
