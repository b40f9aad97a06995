"""Costs: derivation rules, per-stage sharing, hops, recomputation and checks, on known numbers."""

import math

import pytest

from schedules import Costs, Link, Op, interleaved_1f1b, one_f_one_b, zero_bubble_v


def test_backward_is_split_in_halves_by_default_and_twice_forward_when_absent():
    table = Costs(forward=1.5).resolve(one_f_one_b(2, 2))
    assert table.compute[0] == {Op.F: 1.5, Op.B: 3.0, Op.I: 1.5, Op.W: 1.5}
    table = Costs(forward=1, backward=4).resolve(one_f_one_b(2, 2))
    assert table.compute[1] == {Op.F: 1.0, Op.B: 4.0, Op.I: 2.0, Op.W: 2.0}


def test_given_split_takes_precedence_and_the_rest_is_derived():
    schedule = one_f_one_b(2, 2)
    both = Costs(input_grad=3, weight_grad=1).resolve(schedule).compute[0]
    assert both == {Op.F: 1.0, Op.B: 4.0, Op.I: 3.0, Op.W: 1.0}
    only_w = Costs(backward=5, weight_grad=(1, 2)).resolve(schedule).compute
    assert [(c[Op.I], c[Op.W]) for c in only_w] == [(4.0, 1.0), (3.0, 2.0)]
    only_i = Costs(backward=5, input_grad=4.5).resolve(schedule).compute[0]
    assert (only_i[Op.I], only_i[Op.W]) == (4.5, 0.5)
    # An explicit backward wins over I + W (a fused backward can be cheaper).
    fused = Costs(backward=3, input_grad=2, weight_grad=2).resolve(schedule).compute[0]
    assert fused[Op.B] == 3.0 and fused[Op.I] == 2.0 and fused[Op.W] == 2.0


def test_a_derived_negative_time_is_rejected():
    with pytest.raises(ValueError, match=r"weight_grad of chunk 0: .* would be -1.0"):
        Costs(backward=2, input_grad=3).resolve(one_f_one_b(2, 2))


def test_from_stages_matches_the_simulate_keywords():
    schedule = one_f_one_b(2, 2)
    plain = Costs.from_stages(forward=1, backward=4).resolve(schedule).compute[0]
    assert plain == {Op.F: 1.0, Op.B: 4.0, Op.I: 2.0, Op.W: 2.0}
    split = Costs.from_stages(forward=1, backward=4, weight=3).resolve(schedule).compute[0]
    assert split == {Op.F: 1.0, Op.B: 7.0, Op.I: 4.0, Op.W: 3.0}


def test_per_stage_values_are_shared_among_a_stage_chunks():
    schedule = interleaved_1f1b(2, 4, chunks_per_stage=2)  # chunks 0, 2 on stage 0
    costs = Costs(forward=(2, 4), backward=(4, 8), activation_bytes=(10, 30),
                  fixed_bytes=(100, 300), per="stage")
    table = costs.resolve(schedule)
    assert [c[Op.F] for c in table.compute] == [1.0, 2.0, 1.0, 2.0]
    assert table.activation_bytes == (5.0, 15.0, 5.0, 15.0)
    assert table.fixed_bytes == (100.0, 300.0)
    per_chunk = Costs(forward=(1, 2, 3, 4), fixed_bytes=(1, 2, 3, 4)).resolve(schedule)
    assert [c[Op.F] for c in per_chunk.compute] == [1.0, 2.0, 3.0, 4.0]
    assert per_chunk.fixed_bytes == (4.0, 6.0)  # chunks 0 + 2, chunks 1 + 3


def test_recompute_modes_and_microbatch_scale():
    schedule = one_f_one_b(2, 3)
    costs = Costs(forward=1, backward=2, microbatch_scale=(1, 1, 0.5), recompute="except_last")
    table = costs.resolve(schedule)
    assert table.recomputed == (True, True, False)
    assert [table.duration(Op.B, m, 0) for m in range(3)] == [3.0, 3.0, 1.0]
    assert [table.duration(Op.F, m, 0) for m in range(3)] == [1.0, 1.0, 0.5]
    assert Costs(recompute="always").resolve(schedule).recomputed == (True,) * 3
    assert Costs().resolve(schedule).recomputed == (False,) * 3
    flags = Costs(recompute=[False, True, False], input_grad=1, weight_grad=1).resolve(schedule)
    assert [flags.duration(op, 1, 1) for op in (Op.I, Op.W, Op.B)] == [2.0, 1.0, 3.0]


def test_hops_by_matrix_link_and_callable():
    schedule = one_f_one_b(3, 2)
    matrix = Costs(comm=[[0, 1, 2], [3, 0, 4], [5, 6, 0]]).resolve(schedule)
    assert matrix.hop(0, 1, 0) == 1.0 and matrix.hop(1, 0, 0) == 3.0
    assert matrix.hop(2, 1, 1) == 6.0 and matrix.hop(1, 2, 1) == 4.0
    assert matrix.hop(0, 0, 0) == 0.0  # the dependency of a backward on its own forward
    link = Costs(comm=Link(latency=0.5, bandwidth=10), input_bytes=(0, 20, 40),
                 microbatch_scale=(1, 0.5)).resolve(schedule)
    assert link.hop(0, 1, 0) == 2.5  # activation into chunk 1: 20 bytes
    assert link.hop(2, 1, 0) == 4.5  # gradient back out of chunk 2: its 40-byte input
    assert link.hop(2, 1, 1) == 2.5  # half-size micro-batch
    seen = []
    Costs(comm=lambda s, d, n: seen.append((s, d, n)) or 0.0, input_bytes=7).resolve(schedule)
    assert sorted(seen) == [(0, 1, 7.0), (1, 0, 7.0), (1, 2, 7.0), (2, 1, 7.0)]


def test_a_stage_turning_the_v_has_no_hop():
    schedule = zero_bubble_v(2, 2)  # chunks 1 and 2 on stage 1
    table = Costs(comm=1.0).resolve(schedule)
    assert table.hop(1, 2, 0) == 0.0 and table.hop(2, 1, 0) == 0.0
    assert table.hop(0, 1, 0) == 1.0 and table.hop(2, 3, 0) == 1.0


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, -1.0])
@pytest.mark.parametrize(
    "field", ["forward", "backward", "input_grad", "weight_grad", "activation_bytes",
              "input_bytes", "fixed_bytes", "microbatch_scale"])
def test_non_finite_or_negative_values_are_named(field, bad):
    value = [1.0, bad] if field == "microbatch_scale" else bad
    expected = "must be finite" if not math.isfinite(bad) else "must be >= 0"
    with pytest.raises(ValueError, match=rf"{field} cost {expected}"):
        Costs(**{field: value})


def test_a_bad_item_of_a_sequence_is_located():
    with pytest.raises(ValueError, match=r"backward cost must be finite, got nan \(item 1\)"):
        Costs(backward=[1.0, math.nan])


@pytest.mark.parametrize(
    ("comm", "message"),
    [
        (math.inf, r"comm must be finite, got inf"),
        ([[0, math.nan], [0, 0]], r"comm\[0\]\[1\] must be finite"),
        (lambda s, d, n: math.inf, r"comm\(1, 0, 0\) must be finite, got inf"),
        (lambda s, d, n: -1, r"comm\(1, 0, 0\) must be >= 0, got -1.0"),
        ([[0, 1]], r"comm matrix: expected 2 rows of 2 .*got rows of \[2\]"),
    ],
)
def test_bad_hops_are_named(comm, message):
    with pytest.raises(ValueError, match=message):
        Costs(comm=comm).resolve(one_f_one_b(2, 2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"forward": (1, 2, 3)},
         r"forward cost: expected one number or 2 per-chunk numbers, got 3"),
        ({"activation_bytes": (1,), "per": "stage"},
         r"activation_bytes cost: expected one number or 2 per-stage numbers, got 1"),
        ({"microbatch_scale": (1, 1, 1)}, r"microbatch_scale: expected 2 numbers .*got 3"),
        ({"recompute": (True,)}, r"recompute: expected 2 bools .*got 1"),
    ],
)
def test_lengths_are_checked_against_the_schedule(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Costs(**kwargs).resolve(one_f_one_b(2, 2))


def test_bad_modes_and_types():
    with pytest.raises(ValueError, match=r"recompute: expected one of never, except_last, always"):
        Costs(recompute="sometimes")
    with pytest.raises(ValueError, match=r"per: expected 'chunk' or 'stage', got 'layer'"):
        Costs(per="layer")
    with pytest.raises(TypeError, match=r"forward: expected a number or a sequence"):
        Costs(forward="1.0")
    with pytest.raises(ValueError, match=r"Link bandwidth: expected a number > 0, got 0"):
        Link(bandwidth=0)


def test_costs_are_frozen_and_normalised():
    costs = Costs(forward=[1, 2], recompute=[1, 0])
    assert costs.forward == (1.0, 2.0) and costs.recompute == (True, False)
    with pytest.raises(AttributeError):
        costs.forward = 3.0  # type: ignore[misc]
