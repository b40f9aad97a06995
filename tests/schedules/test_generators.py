"""The checks every schedule generator shares, each written once and run for every generator.

Each generator's own file keeps what sets it apart (its literal timetables, its bounds).
"""

import doctest
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import (Action, Op, get_schedule, gpipe, one_f_one_b, schedule_info,
                       schedule_names, simulate, validate)

# GPipe and 1F1B: the same bubble (P-1)/(M+P-1) and makespan, different memory.
FLUSHED = {"gpipe": gpipe, "1f1b": one_f_one_b}
PEAKS = {
    "gpipe": lambda stages, microbatches: (microbatches,) * stages,
    "1f1b": lambda stages, microbatches: tuple(min(stages - s, microbatches)
                                              for s in range(stages)),
}


@pytest.mark.parametrize("name", FLUSHED)
@pytest.mark.parametrize("stages", range(1, 9))
def test_bubble_makespan_idle_and_peaks_match_the_formulas(name, stages):
    for microbatches in range(1, 33):
        schedule = FLUSHED[name](stages, microbatches)
        validate(schedule)
        timeline = simulate(schedule, forward=1, backward=2, comm=0)
        expected = Fraction(stages - 1, microbatches + stages - 1)
        case = f"{name} P={stages} M={microbatches}"
        assert math.isclose(timeline.bubble_fraction, expected, rel_tol=1e-12, abs_tol=0), case
        assert timeline.makespan == (microbatches + stages - 1) * 3, case
        assert timeline.idle == ((stages - 1) * 3.0,) * stages, case
        assert timeline.peak_activations == PEAKS[name](stages, microbatches), case


@pytest.mark.parametrize("name", FLUSHED)
@settings(max_examples=40, deadline=None)
@given(
    stages=st.integers(1, 24),
    microbatches=st.integers(1, 96),
    scale=st.sampled_from([0.5, 1, 3]),
)
def test_formulas_beyond_the_grid(name, stages, microbatches, scale):
    # Any forward cost f with backward 2f: bubble (P-1)/(M+P-1), makespan 3f(M+P-1).
    timeline = simulate(FLUSHED[name](stages, microbatches), forward=scale, backward=2 * scale)
    expected = Fraction(stages - 1, microbatches + stages - 1)
    assert math.isclose(timeline.bubble_fraction, expected, rel_tol=1e-12, abs_tol=0)
    assert math.isclose(timeline.makespan, 3 * scale * (microbatches + stages - 1), rel_tol=1e-12)
    assert timeline.peak_activations == PEAKS[name](stages, microbatches)


@pytest.mark.parametrize("name", schedule_names())
@pytest.mark.parametrize(
    ("stages", "microbatches", "message"),
    [
        (0, 4, "stages must be >= 1, got stages=0"),
        (-2, 4, "stages must be >= 1, got stages=-2"),
        (3, 0, "microbatches must be >= 1, got microbatches=0"),
        (3, -1, "microbatches must be >= 1, got microbatches=-1"),
        (3, 2.0, "microbatches must be an int >= 1, got 2.0"),
        (True, 2, "stages must be an int >= 1, got True"),
        ("3", 4, "stages must be an int >= 1, got '3'"),
    ],
)
def test_bad_counts_raise_value_error(name, stages, microbatches, message):
    with pytest.raises(ValueError, match=message):
        schedule_info(name).generator(stages, microbatches)


def _cases(name):
    """(P, M, options) for ``name``: one stage, fewer micro-batches than stages, on to 4P."""
    info = schedule_info(name)
    for stages in range(1, 9):
        counts = {*range(1, 2 * stages + 2), 3 * stages, 3 * stages + 1, 4 * stages}
        if info.min_microbatches:  # a floor on M: every M from it up to 4P
            counts = set(range(info.min_microbatches(stages), 4 * stages + 1))
        yield from ((stages, m, {}) for m in sorted(counts))
        if "chunks_per_stage" in info.options:
            yield from ((stages, 7, {"chunks_per_stage": v}) for v in (1, 3))
        if "max_inflight" in info.options:
            yield from ((stages, 2 * stages, {"max_inflight": k})
                        for k in range(stages, 2 * stages + 1))


@pytest.mark.parametrize("name", schedule_names())
def test_every_action_once_on_the_stage_holding_its_chunk(name):
    """A forward and a backward (B, or I and W where the backward is split) of each
    micro-batch on each chunk, nothing else, on the stage the placement names."""
    info = schedule_info(name)
    backwards = ((Op.I, Op.W), (Op.B,)) if name.startswith("dualpipe-v") else (
        ((Op.I, Op.W),) if info.split_backward else ((Op.B,),))
    for stages, microbatches, options in _cases(name):
        schedule = info.generator(stages, microbatches, **options)
        case = f"{name} P={stages} M={microbatches} {options}"
        validate(schedule)
        assert schedule.name == name, case
        chunks = info.chunks(**options) * stages
        if info.placement == "v":
            assert schedule.placement == tuple(min(c, 2 * stages - 1 - c) for c in range(chunks))
        else:
            assert schedule.placement == tuple(c % stages for c in range(chunks)), case
        allowed = [sorted(ops, key=str) for ops in backwards]
        for stage, actions in enumerate(schedule.order):
            present = set(actions)
            assert len(actions) == len(present), case
            expected = set()
            for chunk in schedule.chunks_of_stage[stage]:
                assert schedule.placement[chunk] == stage, case
                for m in range(microbatches):
                    held = [op for op in (Op.B, Op.I, Op.W) if Action(op, m, chunk) in present]
                    assert sorted(held, key=str) in allowed, f"{case}: {held} of {m}@c{chunk}"
                    expected |= {Action(op, m, chunk) for op in (Op.F, *held)}
            assert present == expected, case
        spelled = name.upper().replace("-", "_")
        assert get_schedule(spelled, stages, microbatches, **options) == schedule, case


def test_no_two_generators_show_the_same_timetable_in_their_doctests():
    """Each docstring shows what sets its schedule apart, not a grid another one prints."""
    finder = doctest.DocTestFinder()
    shown: dict[str, str] = {}
    for name in schedule_names():
        generator = schedule_info(name).generator
        for test in finder.find(generator, generator.__name__):
            for example in test.examples:
                if example.want.startswith("stage 0:"):
                    grid = " ".join(example.want.split())
                    assert grid not in shown, f"{name} shows {shown.get(grid)}'s timetable"
                    shown[grid] = name
    # V-Min's timetable is V-Half's where a small one fits: it shows its peaks and step instead.
    assert set(shown.values()) == set(schedule_names()) - {"v-min"}
