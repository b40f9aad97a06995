"""Draw a Timeline as a Gantt chart: one row per stage, a box per action, gaps are bubbles."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from schedules.action import Action, Op
from schedules.timeline import Event, Timeline

if TYPE_CHECKING:
    from schedules.comm import CommPlan

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

# Label sizing, in points. A digit of DejaVu Sans (matplotlib's default) is about
# 0.64 of the font size wide; a label needs that per character plus a margin.
_FONT_POINTS = 7.0
_MIN_FONT_POINTS = 5.5
_DIGIT_WIDTH = 0.64
_LABEL_MARGIN_POINTS = 3.0
# Layout of a figure plot_timeline makes itself, in inches.
_ROW_INCHES = 0.42
_MARGINS = {"left": 0.85, "right": 1.4, "top": 0.45, "bottom": 0.5}
_MIN_AXES_INCHES, _MAX_AXES_INCHES = 5.0, 36.0


def plot_timeline(
    timeline: Timeline, ax: Any = None, title: str | None = None, comm: CommPlan | None = None
) -> Any:
    """Draw ``timeline`` on ``ax`` (a new figure if None) and return the Axes.

    Stage 0 is the top row. Each action is a box coloured by its op with its
    micro-batch number inside (and the chunk, ``3/1``, when a stage holds several
    chunks); lighter shades mark later chunks. Idle time is left empty. The title
    gives the bubble fraction and, for a simulated timeline, its lower bound.

    A new figure is made wide enough for the numbers to fit the shortest box at
    a legible size (up to 36 inches of plot); on a given ``ax``, or past that
    width, numbers that would not fit are left out rather than shrunk unreadably.

    Args:
        timeline: a simulated or measured Timeline.
        ax: a matplotlib Axes to draw on, or None for a new figure.
        title: replaces the default title (the timeline's name).
        comm: a comm plan of the timeline's schedule; if given, every message is an
            arrow from the end of its producer's box to the start of the box that
            first needs it, dark for activations, grey for gradients, drawn under
            the numbers. A stage's receives are posted before that box starts.

    Returns:
        The matplotlib Axes.

    Raises:
        ValueError: ``comm`` moves a result the timeline has no event for.
    """
    labels = {event: _label(timeline, event) for event in timeline.events}
    if ax is None:
        ax = _new_axes(timeline, labels)
    _draw_boxes(ax, timeline)
    if comm is not None:
        _draw_messages(ax, timeline, comm)
    _draw_labels(ax, timeline, labels)
    _decorate(ax, timeline, title)
    return ax


def _label(timeline: Timeline, event: Event) -> str:
    action = event.action
    if timeline.chunks_per_stage[event.stage] > 1:
        return f"{action.microbatch}/{action.chunk}"
    return str(action.microbatch)


def _label_points(label: str, fontsize: float) -> float:
    """The box width, in points, that ``label`` needs at ``fontsize``."""
    return len(label) * _DIGIT_WIDTH * fontsize + _LABEL_MARGIN_POINTS


def _new_axes(timeline: Timeline, labels: dict[Event, str]) -> Any:
    import matplotlib.pyplot as plt

    # Scale time so that the shortest box holds its label at the full font size.
    points_per_unit = max(
        (_label_points(labels[e], _FONT_POINTS) / e.duration for e in timeline.events
         if e.duration > 0),
        default=0.0,
    )
    wanted = timeline.makespan * points_per_unit / 72.0
    axes_width = min(max(wanted, _MIN_AXES_INCHES), _MAX_AXES_INCHES)
    axes_height = _ROW_INCHES * max(timeline.stages, 1)
    width = axes_width + _MARGINS["left"] + _MARGINS["right"]
    height = axes_height + _MARGINS["top"] + _MARGINS["bottom"]
    figure, ax = plt.subplots(figsize=(width, height))
    figure.subplots_adjust(
        left=_MARGINS["left"] / width,
        right=1.0 - _MARGINS["right"] / width,
        bottom=_MARGINS["bottom"] / height,
        top=1.0 - _MARGINS["top"] / height,
    )
    return ax


def _chunk_shades(timeline: Timeline) -> dict[tuple[int, int], int]:
    """``(stage, chunk)`` -> 0 for a stage's first chunk, 1 for its second, and so on."""
    chunks: dict[int, set[int]] = defaultdict(set)
    for event in timeline.events:
        chunks[event.stage].add(event.action.chunk)
    return {
        (stage, chunk): rank
        for stage, held in chunks.items()
        for rank, chunk in enumerate(sorted(held))
    }


def _row(timeline: Timeline, stage: int) -> int:
    return timeline.stages - 1 - stage  # stage 0 on top


def _points_per_unit(ax: Any, timeline: Timeline) -> float:
    """How many points of the axes' width one unit of time takes."""
    axes_points: float = ax.get_position().width * ax.get_figure().get_figwidth() * 72.0
    return axes_points / (timeline.makespan or 1.0)


def _draw_boxes(ax: Any, timeline: Timeline) -> None:
    from matplotlib.colors import to_rgba

    shades = _chunk_shades(timeline)
    # One collection per row and colour, a rectangle per event: fast at 100k events.
    groups: dict[tuple[int, Op, int], list[tuple[float, float]]] = defaultdict(list)
    origin = timeline.start
    for event in timeline.events:
        shade = min(shades[(event.stage, event.action.chunk)], 2)
        key = (event.stage, event.action.op, shade)
        groups[key].append((event.start - origin, event.duration))
    # White edges separate adjacent boxes; on boxes a few points wide they would
    # wash the colours out, so there the boxes touch.
    shortest = min((e.duration for e in timeline.events if e.duration > 0), default=0.0)
    edge = 0.6 if shortest * _points_per_unit(ax, timeline) >= 4.0 else 0.0
    for (stage, op, shade), spans in groups.items():
        ax.broken_barh(
            spans,
            (_row(timeline, stage) - 0.4, 0.8),
            facecolors=to_rgba(OP_COLOURS[op], alpha=1.0 - 0.35 * shade / 2),
            edgecolors="white",
            linewidth=edge,
        )


def _draw_labels(ax: Any, timeline: Timeline, labels: dict[Event, str]) -> None:
    if not timeline.events:
        return
    box = ax.get_position()
    row_points = box.height * ax.get_figure().get_figheight() * 72.0 / max(timeline.stages, 1)
    points_per_unit = _points_per_unit(ax, timeline)
    # One font size for every number: the largest at which all of them fit, if that
    # is legible; otherwise the full size, and boxes too short for it stay blank.
    fitting = min(
        (
            (e.duration * points_per_unit - _LABEL_MARGIN_POINTS) / (len(labels[e]) * _DIGIT_WIDTH)
            for e in timeline.events
            if e.duration > 0
        ),
        default=_FONT_POINTS,
    )
    fontsize = min(fitting if fitting >= _MIN_FONT_POINTS else _FONT_POINTS, _FONT_POINTS)
    fontsize = min(fontsize, 0.6 * row_points)
    if fontsize < _MIN_FONT_POINTS:
        return
    origin = timeline.start
    for event in timeline.events:
        label = labels[event]
        if event.duration * points_per_unit >= _label_points(label, fontsize):
            ax.text(
                event.start - origin + event.duration / 2,
                _row(timeline, event.stage),
                label,
                ha="center",
                va="center",
                fontsize=fontsize,
                color="white",
            )


_ARROW_COLOURS = {Op.F: "#222222", Op.B: "#888888", Op.I: "#888888"}


def _draw_messages(ax: Any, timeline: Timeline, comm: CommPlan) -> None:
    """An arrow per received message: producer's end to its first consumer's start."""
    from schedules.dependencies import dependencies

    events = {(event.stage, event.action): event for event in timeline.events}
    origin = timeline.start
    for stage, steps in enumerate(comm.stages):
        first: dict[Action, Action] = {}
        for step in steps:
            if isinstance(step, Action):
                for needed in dependencies(comm.schedule, step):
                    first.setdefault(needed, step)
        for step in steps:
            if isinstance(step, Action):
                continue
            for op in step.ops:
                if op.kind != "recv":
                    continue
                consumer = first.get(op.producer)
                start = events.get((op.peer, op.producer))
                end = events.get((stage, consumer)) if consumer is not None else None
                if start is None or end is None:
                    missing = op.producer if start is None else consumer
                    raise ValueError(
                        f"comm plan and timeline differ: the plan moves {op.producer} from "
                        f"stage {op.peer} to stage {stage}, but the timeline has no event for "
                        f"{missing}; pass the plan of the schedule the timeline ran"
                    )
                colour = _ARROW_COLOURS.get(op.producer.op, "grey")
                _arrow(ax, timeline, start, end, origin, colour)


def _arrow(ax: Any, timeline: Timeline, source: Event, target: Event, origin: float,
           colour: str) -> None:
    down = source.stage < target.stage  # stage 0 is the top row
    y0 = _row(timeline, source.stage) + (-0.4 if down else 0.4)
    y1 = _row(timeline, target.stage) + (0.4 if down else -0.4)
    ax.annotate(
        "", xy=(target.start - origin, y1), xytext=(source.end - origin, y0),
        arrowprops={"arrowstyle": "-|>", "color": colour, "lw": 0.8, "alpha": 0.8,
                    "shrinkA": 0, "shrinkB": 0, "mutation_scale": 7},
        zorder=3,
    )


def _decorate(ax: Any, timeline: Timeline, title: str | None) -> None:
    from matplotlib.patches import Patch

    ax.set_yticks(range(timeline.stages))
    ax.set_yticklabels([f"stage {s}" for s in reversed(range(timeline.stages))])
    ax.tick_params(axis="y", length=0)
    ax.set_xlim(0, timeline.makespan or 1.0)
    ax.set_ylim(-0.6, timeline.stages - 0.4)
    ax.set_xlabel("time")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ops = sorted({e.action.op for e in timeline.events}, key=list(Op).index)
    if ops:
        # Outside the plot, to the right: it can never hide a box or a gap.
        several = max(timeline.chunks_per_stage, default=1) > 1
        legend = ax.legend(
            handles=[Patch(color=OP_COLOURS[op], label=OP_LABELS[op]) for op in ops],
            loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
            borderaxespad=0.0,
            title="micro-batch/chunk\n(lighter: later chunk)" if several else "micro-batch",
            title_fontsize=7,
            alignment="left",
        )
        legend.get_title().set_multialignment("left")
    heading = title if title is not None else (timeline.name or "pipeline timeline")
    detail = f"bubble {timeline.bubble_fraction:.1%}"
    if timeline.bubble_bound is not None:
        detail += f" (lower bound {max(timeline.bubble_bound, 0.0):.1%})"
    ax.set_title(f"{heading}: {detail}", fontsize=10, loc="left")
