"""The measured Timeline is the schedule as it ran: same order, causal, no overlaps, drawable."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.image
import matplotlib.pyplot as plt
import pytest
from torch import nn

from models import batch, build
from pipeline import Pipe
from schedules import Op, Timeline, dependencies, plot_timeline, simulate

SAVE_TO = os.environ.get("PIPESCHED_SAVE_PLOTS")  # a folder, to look at the plots
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")


def measured(schedule: str, stages: int = 4, chunks: int = 8, checkpoint: str = "except_last"
             ) -> tuple[Pipe, Timeline]:
    model = build("mlp")
    x, target = batch("mlp", 16)
    pipe = Pipe(model, chunks, stages=stages, schedule=schedule, checkpoint=checkpoint,
                loss_fn=nn.MSELoss())
    pipe.step(x, target)
    timeline = pipe.timeline
    assert timeline is not None
    return pipe, timeline


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_stage_runs_the_schedule_order(schedule: str) -> None:
    pipe, timeline = measured(schedule)
    assert timeline.stages == pipe.schedule.stages
    assert len(timeline.events) == sum(len(actions) for actions in pipe.schedule.order)
    for stage in range(pipe.schedule.stages):
        assert timeline.stage_order(stage) == pipe.schedule.order[stage], f"stage {stage}"
        assert {e.stage for e in timeline.stage_events(stage)} == {stage}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_events_do_not_overlap_and_respect_dependencies(schedule: str) -> None:
    pipe, timeline = measured(schedule)
    ends = {}
    for stage in range(timeline.stages):
        events = timeline.stage_events(stage)
        for event in events:
            assert event.end >= event.start
            ends[event.action] = event.end
        for before, after in zip(events, events[1:]):
            assert before.end <= after.start, f"stage {stage}: {before} overlaps {after}"
    for event in timeline.events:
        for needed in dependencies(pipe.schedule, event.action):
            assert ends[needed] <= event.start, f"{event.action} started before {needed} ended"


def test_timeline_describes_the_step() -> None:
    pipe, timeline = measured("interleaved-1f1b")
    assert timeline.chunks_per_stage == (2, 2, 2, 2)
    assert "interleaved-1f1b" in timeline.name and "measured" in timeline.name
    assert timeline.start >= 0.0
    assert 0.0 < timeline.bubble_fraction < 1.0
    assert timeline.makespan > 0.0
    # The measured timeline has the simulator's peaks: they depend on the order alone.
    assert timeline.peak_activations == simulate(pipe.schedule).peak_activations
    ops = {e.action.op for e in timeline.events}
    assert ops == {Op.F, Op.B}


def test_split_backward_appears_in_the_timeline() -> None:
    _, timeline = measured("zb-h1")
    assert {e.action.op for e in timeline.events} == {Op.F, Op.I, Op.W}


def test_each_step_replaces_the_timeline() -> None:
    pipe, first = measured("1f1b", stages=2, chunks=3)
    x, target = batch("mlp", 16)
    pipe.step(x, target)
    assert pipe.timeline is not first
    assert pipe.timeline is not None and len(pipe.timeline.events) == len(first.events)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_plot_of_the_measured_timeline_is_a_readable_png(schedule: str, tmp_path: Path) -> None:
    _, timeline = measured(schedule)
    ax = plot_timeline(timeline)
    path = tmp_path / f"{schedule}.png"
    ax.figure.savefig(path, dpi=100)
    if SAVE_TO:
        ax.figure.savefig(Path(SAVE_TO) / path.name, dpi=100)
    plt.close(ax.figure)
    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert height >= 100 and width >= 300
    # Not blank: the boxes put colour on the white background.
    assert image[..., :3].std() > 0.05
    boxes = sum(len(collection.get_paths()) for collection in ax.collections)
    assert boxes == len(timeline.events)
    assert [label.get_text() for label in ax.get_yticklabels()] == [
        f"stage {s}" for s in reversed(range(timeline.stages))
    ]
