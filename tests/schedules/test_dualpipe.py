"""DualPipeV: the eight phases, M >= 2P, and the bubble of DeepSeek's README."""

import pytest

from schedules import dualpipe_v, simulate

GRID = [(p, m) for p in range(1, 9) for m in range(2 * p, 4 * p + 1)]


def test_needs_twice_as_many_microbatches_as_stages():
    with pytest.raises(ValueError, match=r"expected microbatches >= 8 for stages=4, got microbatches=7"):
        dualpipe_v(4, 7)
    with pytest.raises(ValueError, match="stages must be >= 1"):
        dualpipe_v(0, 4)


def test_idle_matches_the_readme_formula_with_equal_costs():
    # (PP/2 - 1)(F&B + B - 3W) per stage, PP = 2P chunks, with a chunk's F = I = W = 1/2
    # and F&B = F + W (see the module docstring): (P - 1) / 2.
    for stages, microbatches in GRID:
        timeline = simulate(dualpipe_v(stages, microbatches), forward=1, backward=1, weight=1)
        f = i = w = 0.5
        expected = (stages - 1) * ((f + w) + (i + w) - 3 * w)
        assert timeline.idle == pytest.approx((expected,) * stages, abs=1e-9), (stages, microbatches)


@pytest.mark.parametrize(("f", "i", "w"), [(1, 1, 1), (2, 1, 1), (1, 1, 2), (1, 1, 0.5), (3, 2, 1)])
def test_idle_is_p_minus_one_times_max_of_f_plus_i_minus_w_and_f(f, i, w):
    for stages in (2, 4, 6):
        microbatches = 3 * stages
        timeline = simulate(dualpipe_v(stages, microbatches), forward=2 * f, backward=2 * i,
                            weight=2 * w)
        expected = (stages - 1) * max(f + i - w, f)
        assert timeline.idle == pytest.approx((expected,) * stages, abs=1e-9)


def test_holds_p_plus_a_half():
    for stages, microbatches in GRID:
        peaks = simulate(dualpipe_v(stages, microbatches)).peak_activations
        assert peaks == (stages + 0.5,) * stages
