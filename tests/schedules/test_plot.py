"""plot_timeline: a box per action where it ran, legible numbers, stages and bubble labelled."""

import matplotlib

matplotlib.use("Agg")  # files only, never a window

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from schedules import (  # noqa: E402
    Action, Event, Schedule, Timeline, gpipe, one_f_one_b, plot_timeline, simulate,
)
from schedules.plot import OP_COLOURS  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _boxes(ax):
    """Every drawn box as (row, left, right, rgb), read back from the Axes."""
    boxes = []
    for collection in ax.collections:
        colours = collection.get_facecolors()
        for index, path in enumerate(collection.get_paths()):
            extent = path.get_extents()
            rgb = tuple(colours[index % len(colours)][:3])
            boxes.append((round((extent.y0 + extent.y1) / 2), extent.x0, extent.x1, rgb))
    boxes += [
        (round(p.get_y() + p.get_height() / 2), p.get_x(), p.get_x() + p.get_width(),
         tuple(p.get_facecolor()[:3]))
        for p in ax.patches
    ]
    return boxes


def _assert_one_box_per_event_where_it_ran(ax, timeline):
    boxes = sorted(_boxes(ax))
    assert len(boxes) == len(timeline.events)
    expected = sorted(
        (timeline.stages - 1 - e.stage, e.start - timeline.start, e.end - timeline.start,
         to_rgb(OP_COLOURS[e.action.op]))
        for e in timeline.events
    )
    for (row, left, right, rgb), (row2, left2, right2, rgb2) in zip(boxes, expected):
        assert row == row2
        assert left == pytest.approx(left2) and right == pytest.approx(right2)
        assert rgb == pytest.approx(rgb2)
    # Nothing else is drawn, so idle time is empty: drawn width per row is the busy time.
    for stage in range(timeline.stages):
        row = timeline.stages - 1 - stage
        drawn = sum(right - left for r, left, right, _ in boxes if r == row)
        assert drawn == pytest.approx(timeline.busy[stage])


def _box_of(ax, timeline, text):
    """The event whose box contains ``text``'s anchor."""
    x, y = text.get_position()
    stage = timeline.stages - 1 - round(y)
    for event in timeline.events:
        left = event.start - timeline.start
        if event.stage == stage and left < x < left + event.duration:
            return event
    raise AssertionError(f"label {text.get_text()!r} at {x, y} is in no box")


def _assert_readable(ax, timeline, every_box_labelled, label=lambda a: str(a.microbatch)):
    figure = ax.figure
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    texts = ax.texts
    if every_box_labelled:
        assert len(texts) == len(timeline.events)
    sizes = {text.get_fontsize() for text in texts}
    assert len(sizes) <= 1 and all(size >= 5.5 for size in sizes)  # one legible size
    for text in texts:
        event = _box_of(ax, timeline, text)
        assert text.get_text() == label(event.action)
        # The number fits inside its box, so numbers never run into each other.
        left, _ = ax.transData.transform((event.start - timeline.start, 0))
        right, _ = ax.transData.transform((event.end - timeline.start, 0))
        extent = text.get_window_extent(renderer)
        assert left <= extent.x0 and extent.x1 <= right, text.get_text()
    labels = [label.get_text() for label in ax.get_yticklabels()]
    assert labels == [f"stage {s}" for s in reversed(range(timeline.stages))]  # stage 0 on top
    # Legend and title are inside the figure and clear of the boxes and of each other.
    axes_box = ax.get_window_extent(renderer)
    figure_box = figure.bbox
    legend_box = ax.get_legend().get_window_extent(renderer)
    heading = next(ax.get_title(loc) for loc in ("left", "center", "right") if ax.get_title(loc))
    title = next(c for c in ax.get_children() if isinstance(c, Text) and c.get_text() == heading)
    title_box = title.get_window_extent(renderer)
    assert not legend_box.overlaps(axes_box)
    assert not legend_box.overlaps(title_box)
    for box in (legend_box, title_box, ax.xaxis.label.get_window_extent(renderer)):
        assert figure_box.x0 <= box.x0 and box.x1 <= figure_box.x1
        assert figure_box.y0 <= box.y0 and box.y1 <= figure_box.y1
    return title.get_text()


@pytest.mark.parametrize(("stages", "microbatches"), [(4, 8), (8, 32)])
def test_1f1b_timeline_is_readable_and_saved(tmp_path, stages, microbatches):
    timeline = simulate(one_f_one_b(stages, microbatches))
    ax = plot_timeline(timeline)
    assert isinstance(ax, Axes)
    _assert_one_box_per_event_where_it_ran(ax, timeline)
    title = _assert_readable(ax, timeline, every_box_labelled=True)
    assert f"bubble {timeline.bubble_fraction:.1%}" in title
    assert f"{(stages - 1) / (microbatches + stages - 1):.1%}" in title
    assert title.startswith("1f1b (simulated)")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward", "backward"]

    path = tmp_path / f"1f1b_{stages}x{microbatches}.png"
    ax.figure.savefig(path)
    assert path.stat().st_size > 10_000
    image = plt.imread(path)
    assert image.shape[1] > image.shape[0] > 100  # a wide Gantt chart
    assert len({tuple(pixel) for pixel in image.reshape(-1, image.shape[2])[::7]}) > 20


def test_gpipe_with_uneven_costs_and_comm():
    timeline = simulate(gpipe(3, 5), forward=[1, 2, 1], backward=[2, 4, 2], comm=0.5)
    ax = plot_timeline(timeline, title="uneven")
    _assert_one_box_per_event_where_it_ran(ax, timeline)
    title = _assert_readable(ax, timeline, every_box_labelled=True)
    assert title.startswith(f"uneven: bubble {timeline.bubble_fraction:.1%}")
    assert "lower bound" in title


def test_draws_on_a_given_axes_and_drops_numbers_that_do_not_fit():
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(6, 6))
    # 65 time units across ~4.7 inches: a forward box (1 unit) is too short for a
    # legible number, a backward box (4 units) is not.
    timeline = simulate(gpipe(2, 12), forward=1, backward=4)
    assert plot_timeline(timeline, ax=bottom) is bottom
    assert not top.collections and not top.texts
    _assert_one_box_per_event_where_it_ran(bottom, timeline)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    labelled = []
    for text in bottom.texts:
        event = _box_of(bottom, timeline, text)
        labelled.append(event.action)
        left, _ = bottom.transData.transform((event.start - timeline.start, 0))
        right, _ = bottom.transData.transform((event.end - timeline.start, 0))
        extent = text.get_window_extent(renderer)
        assert left <= extent.x0 and extent.x1 <= right
        assert text.get_fontsize() >= 5.5
    backwards = [e.action for e in timeline.events if e.action.op.value == "B"]
    assert sorted(labelled, key=str) == sorted(backwards, key=str)


def test_measured_timeline_starts_at_zero():
    events = [
        Event(0, Action.parse("F0"), 50.0, 50.5),
        Event(1, Action.parse("F0@c1"), 50.75, 51.0),
        Event(1, Action.parse("B0@c1"), 51.0, 52.0),
        Event(0, Action.parse("B0"), 52.25, 53.0),
    ]
    timeline = Timeline(stages=2, events=events, name="measured")
    ax = plot_timeline(timeline)
    assert ax.get_xlim() == (0.0, 3.0)
    _assert_one_box_per_event_where_it_ran(ax, timeline)
    title = _assert_readable(ax, timeline, every_box_labelled=True)
    assert title == f"measured: bubble {timeline.bubble_fraction:.1%}"  # no bound when measured


def test_several_chunks_per_stage_show_the_chunk():
    lines = ("F0 F1 F0@c2 F1@c2 B0@c2 B1@c2 B0 B1",
             "F0@c1 F1@c1 F0@c3 F1@c3 B0@c3 B1@c3 B0@c1 B1@c1")
    order = [[Action.parse(text) for text in line.split()] for line in lines]
    timeline = simulate(Schedule(2, 2, order, placement=(0, 1, 0, 1)))
    ax = plot_timeline(timeline)
    _assert_readable(ax, timeline, every_box_labelled=True,
                     label=lambda a: f"{a.microbatch}/{a.chunk}")
    assert "chunk" in ax.get_legend().get_title().get_text()
    # A stage's second chunk is drawn lighter than its first.
    alphas = {}
    for collection in ax.collections:
        for path in collection.get_paths():
            x = path.get_extents().x0
            event = next(e for e in timeline.events if abs(e.start - x) < 1e-9
                         and timeline.stages - 1 - e.stage == round(path.get_extents().y0 + 0.4))
            alphas[event.action.chunk] = collection.get_facecolors()[0][3]
    assert alphas[0] == alphas[1] == 1.0
    assert alphas[2] == alphas[3] < 1.0


def test_empty_timeline_draws_nothing():
    ax = plot_timeline(Timeline(stages=2, events=()))
    assert not ax.collections and not ax.texts
    assert "bubble 0.0%" in ax.get_title(loc="left")


@pytest.mark.parametrize(("name", "stages", "microbatches"),
                         [("1f1b", 4, 8), ("zb-v", 3, 6), ("interleaved-1f1b", 3, 6)])
def test_comm_plan_draws_an_arrow_per_message(tmp_path, name, stages, microbatches):
    from matplotlib.text import Annotation

    from schedules import comm_plan, get_schedule, transfers

    schedule = get_schedule(name, stages, microbatches)
    timeline = simulate(schedule, comm=0.2)
    plan = comm_plan(schedule)
    ax = plot_timeline(timeline, comm=plan)
    arrows = [child for child in ax.get_children() if isinstance(child, Annotation)]
    messages = {(t.producer, t.destination) for t in transfers(schedule)}
    assert len(arrows) == len(messages) > 0
    # Each arrow runs from its producer's end to its first consumer's start.
    ends = {e.end - timeline.start for e in timeline.events}
    starts = {e.start - timeline.start for e in timeline.events}
    for arrow in arrows:
        assert min(abs(arrow.xyann[0] - x) for x in ends) < 1e-9
        assert min(abs(arrow.xy[0] - x) for x in starts) < 1e-9
        assert arrow.xyann[0] <= arrow.xy[0] + 1e-9  # data moves forward in time
    # The numbers are still there, one per box, drawn above the arrows.
    numbers = [text for text in ax.texts if not isinstance(text, Annotation)]
    assert len(numbers) == len(timeline.events)
    assert min(t.get_zorder() for t in numbers) >= max(a.get_zorder() for a in arrows)
    path = tmp_path / f"{name}.png"
    ax.figure.savefig(path)
    assert path.stat().st_size > 10_000


def test_comm_plan_of_another_schedule_is_refused():
    from schedules import comm_plan

    timeline = simulate(one_f_one_b(2, 2))
    with pytest.raises(ValueError, match=r"comm plan and timeline differ: .*no event for (F2|B2@c1)"):
        plot_timeline(timeline, comm=comm_plan(one_f_one_b(2, 3)))
