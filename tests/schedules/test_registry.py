"""get_schedule: by name, case-insensitive, and an unknown name lists the known ones."""

import pytest

from schedules import get_schedule, gpipe, one_f_one_b, schedule_names


def test_known_names():
    assert {"gpipe", "1f1b"} <= set(schedule_names())


@pytest.mark.parametrize(
    ("name", "generator"),
    [
        ("gpipe", gpipe),
        ("GPipe", gpipe),
        (" GPIPE ", gpipe),
        ("1f1b", one_f_one_b),
        ("1F1B", one_f_one_b),
    ],
)
def test_by_name_is_the_generator(name, generator):
    assert get_schedule(name, stages=3, microbatches=5) == generator(3, 5)
    assert get_schedule(name, 2, 4).order == generator(2, 4).order


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError) as error:
        get_schedule("pipedream", stages=2, microbatches=2)
    message = str(error.value)
    assert "'pipedream'" in message
    for name in schedule_names():
        assert name in message


def test_bad_counts_pass_through():
    with pytest.raises(ValueError, match="stages must be >= 1, got stages=0"):
        get_schedule("1f1b", stages=0, microbatches=2)


# Registry facts: what each entry says without building, checked against what it builds.

from schedules import ScheduleInfo, normalize_name, schedule_info, simulate  # noqa: E402

EXISTING = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")


def _grid(info):
    for stages in range(1, 7):
        low = info.min_microbatches(stages) if info.min_microbatches else 1
        for microbatches in sorted({low, low + 1, stages, 2 * stages, 3 * stages + 1}):
            if microbatches >= low:
                yield stages, microbatches


def _option_grid(info, stages):
    if "chunks_per_stage" in info.options:
        return [{}, {"chunks_per_stage": 1}, {"chunks_per_stage": 3}]
    if "max_inflight" in info.options:
        return [{}] + [{"max_inflight": k} for k in range(stages, 2 * stages + 1)]
    return [{}]


def test_names_in_order_and_existing_ones_kept():
    assert schedule_names()[: len(EXISTING)] == EXISTING
    assert set(schedule_names()) >= {"zb", "v-half", "v-min", "dualpipe-v"}


@pytest.mark.parametrize("name", schedule_names())
def test_memory_formula_is_the_simulated_peak(name):
    info = schedule_info(name)
    for stages, microbatches in _grid(info):
        for options in _option_grid(info, stages):
            schedule = info.build(stages, microbatches, **options)
            expected = simulate(schedule, forward=1, backward=1, weight=1).peak_activations
            case = f"{name} P={stages} M={microbatches} {options}"
            assert info.memory(stages, microbatches, **options) == expected, case


@pytest.mark.parametrize("name", schedule_names())
def test_facts_match_the_schedule(name):
    info = schedule_info(name)
    assert isinstance(info, ScheduleInfo) and info.name == name
    for stages, microbatches in _grid(info):
        for options in _option_grid(info, stages):
            schedule = info.build(stages, microbatches, **options)
            per_stage = info.chunks(**options)
            assert schedule.chunks == per_stage * stages
            assert all(len(c) == per_stage for c in schedule.chunks_of_stage)
            if info.placement == "v":
                placement = tuple(min(c, 2 * stages - 1 - c) for c in range(2 * stages))
            else:
                placement = tuple(c % stages for c in range(per_stage * stages))
            assert schedule.placement == placement
            assert bool(schedule.split_backward) == info.split_backward
            assert schedule.name == name


def test_normalize_name_is_the_one_rule():
    assert normalize_name(" ZB_V ") == "zb-v"
    assert schedule_info("Dualpipe_V") is schedule_info("dualpipe-v")
    assert schedule_info("1F1B").chunks() == 1
    assert schedule_info("interleaved_1f1b").chunks(chunks_per_stage=4) == 4


def test_min_microbatches_and_unknown_options():
    assert schedule_info("dualpipe-v").min_microbatches(4) == 8
    assert schedule_info("1f1b").min_microbatches is None
    with pytest.raises(ValueError, match="schedule '1f1b' takes options: none; got chunks_per_stage"):
        get_schedule("1f1b", 2, 4, chunks_per_stage=2)
    with pytest.raises(ValueError, match="takes options: max_inflight; got cap"):
        get_schedule("zb", 2, 4, cap=3)
