"""Draw where a simulated timeline's expert all-to-alls run: a lane under each stage's row, hidden where a pair's other action computes, exposed elsewhere."""

from __future__ import annotations

from typing import Any

from schedules.action import Schedule
from schedules.costs import Costs
from schedules.simulate_pairs import exchange_times
from schedules.timeline import Timeline

HIDDEN_COLOUR = "#9E9E9E"   # grey: runs while the pair's other action computes
EXPOSED_COLOUR = "#C44E52"  # red: the stage waits for it


def draw_exchanges(ax: Any, timeline: Timeline, schedule: Schedule, costs: Costs
                   ) -> tuple[float, float]:
    """Draw on ``ax`` (where ``plot_timeline`` drew ``timeline``, simulated from
    ``schedule`` and ``costs``) each action's all-to-all time as a bar in the thin lane
    under its stage's row; return the time hidden and the time exposed, summed over
    stages.

    An action outside a pair waits for its exchanges: exposed, drawn at the end of its box.
    In a pair (``schedules.pairs``) the backward's exchanges run while the forward
    computes and the forward's while the backward computes: hidden as far as that
    computation lasts, the rest exposed (``schedules.simulate_pairs``).
    """
    table = costs.resolve(schedule)
    hidden = exposed = 0.0
    bars: dict[str, list[tuple[float, float]]] = {"hidden": [], "exposed": []}
    origin = timeline.start
    for stage in range(schedule.stages):
        events = list(timeline.stage_events(stage))
        times = exchange_times(schedule, table, stage)
        pairs = set(schedule.pairs[stage])
        lane = (timeline.stages - 1 - stage - 0.5, 0.09)
        at = 0
        while at < len(events):
            if at in pairs:
                forward, backward = events[at], events[at + 1]
                forward_x, backward_x = times[at], times[at + 1]
                forward_compute = _duration(table, forward) - forward_x
                backward_compute = _duration(table, backward) - backward_x
                for start, length, cover in ((forward.start, backward_x, forward_compute),
                                             (backward.start, forward_x, backward_compute)):
                    covered = min(length, max(cover, 0.0))
                    bars["hidden"].append((start - origin, covered))
                    bars["exposed"].append((start - origin + covered, length - covered))
                    hidden, exposed = hidden + covered, exposed + length - covered
                at += 2
                continue
            event, length = events[at], times[at]
            bars["exposed"].append((event.end - origin - length, length))
            exposed += length
            at += 1
        for kind, colour in (("hidden", HIDDEN_COLOUR), ("exposed", EXPOSED_COLOUR)):
            spans = [(start, length) for start, length in bars[kind] if length > 0]
            if spans:
                ax.broken_barh(spans, lane, facecolors=colour, linewidth=0)
            bars[kind] = []
    return hidden, exposed


def _duration(table: Any, event: Any) -> float:
    action = event.action
    return float(table.duration(action.op, action.microbatch, action.chunk))
