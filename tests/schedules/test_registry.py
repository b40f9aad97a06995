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
