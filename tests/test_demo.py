"""examples/demo.py: its first picture shows every schedule whole, in one process (the 2-rank
training and prediction parts are the examples' own runs, not repeated here)."""

from __future__ import annotations

import matplotlib.pyplot as plt

from examples.demo import DEMO_SCHEDULES, schedules_figure
from schedules import get_schedule, simulate


def test_each_schedule_panel_shows_its_whole_makespan() -> None:
    # On main, the panels shared an x-axis whose limit the last schedule (ZB-V, 25.5) set:
    # GPipe and 1F1B (33) were cut off.
    figure, timelines = schedules_figure(stages=4, microbatches=8)
    assert list(timelines) == list(DEMO_SCHEDULES)
    assert len(figure.axes) == len(DEMO_SCHEDULES)
    longest = max(timeline.makespan for timeline in timelines.values())
    for axis, (name, timeline) in zip(figure.axes, timelines.items()):
        expected = simulate(get_schedule(name, 4, 8), forward=1, backward=1, weight=1)
        assert timeline.makespan == expected.makespan
        low, high = axis.get_xlim()
        assert low <= 0 and high >= timeline.makespan, (name, axis.get_xlim(), timeline.makespan)
        assert high <= 1.05 * longest  # one time scale for all: lengths compare by eye
        assert axis.get_title(loc="left").startswith(f"{name}, makespan {timeline.makespan:g}")
    assert {timeline.makespan for timeline in timelines.values()} != {longest}
    plt.close(figure)
