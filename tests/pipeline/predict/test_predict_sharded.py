"""Pipe.predict and partitioners.plan with data-parallel replicas: sharded bytes and collectives.

A stage sharded by FSDP2 over ``dp`` replicas holds, between steps, 1/dp of its
parameters, gradients and optimizer state; within a step also its whole parameters
(gathered; with ``reshard_after_forward`` only the largest unit) and whole gradients. Its
step pays an all-gather per unit once (or per forward and backward when resharded) and a
reduce-scatter per unit after the last backward; whole copies pay an all-reduce. The
predictions must say so, equal what the ranks hold, and stay exactly as they were
without replicas.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from dist_harness import run_ranks
from partitioners import LayerCost, MemoryLimitError, plan
from partitioners.cut.memory import DataParallelism, gathered_bytes, sharded_fixed_bytes
from partitioners.plan.replicas import (
    StepCollectives,
    gathers_per_action,
    ring_seconds,
    with_step_collectives,
)
from predict_sharded_workers import predicted_and_held
from schedules import Costs, Link, Op, get_schedule, simulate

MODES_2X2 = ("alone", "replicate", "fsdp", "fsdp-reshard")
MODES_1X4 = ("replicate", "fsdp", "fsdp-reshard")
RUNS = [((2, 2), MODES_2X2), ((1, 4), MODES_1X4)]
ADAM = 2  # optimizer state per parameter byte
UNITS = {2: 2, 1: 4}  # FSDP units (Linear layers) per stage, by stage count
TOLERANCE = 1e-9  # relative, for sums of the same floats in another order
Figures = list[list[dict[str, dict[str, Any]]]]  # per rank, per run, per mode


@pytest.fixture(scope="module")
def ranks() -> Figures:
    """Every rank's figures for every run (one spawn for the whole file)."""
    found: Figures = run_ranks(predicted_and_held, 4, RUNS)
    return found


def _each(ranks: Figures) -> Iterator[tuple[Sequence[int], dict[str, dict[str, Any]]]]:
    for found in ranks:
        for (shape, _), run in zip(RUNS, found):
            yield shape, run


# -- Pipe.predict across ranks -----------------------------------------------------------------


def test_the_bytes_predicted_between_steps_are_the_bytes_each_rank_holds(ranks: Figures) -> None:
    for shape, run in _each(ranks):
        for mode, figures in run.items():
            held, predicted = figures["held"], figures["between_steps"]
            assert abs(predicted - held) <= 0.05 * held, (shape, mode, predicted, held)


def test_shards_hold_a_replica_share_between_steps_and_gather_within_one(ranks: Figures) -> None:
    for (stages, replicas), run in _each(ranks):
        whole = run["replicate"]["between_steps"]  # (2 + ADAM) x the stage's parameters
        parameters = whole / (2 + ADAM)
        assert run["replicate"]["within_step"] == whole
        for mode, gathered_share in (("fsdp", 1.0), ("fsdp-reshard", 1 / UNITS[stages])):
            figures = run[mode]
            assert figures["between_steps"] == pytest.approx(whole / replicas, rel=0.05)
            assert figures["gathered"] == pytest.approx(gathered_share * parameters)
            assert figures["unsharded_gradients"] == pytest.approx(parameters)
            factor = ((2 + ADAM) / replicas + 1 + gathered_share) / (2 + ADAM)
            assert figures["within_step"] / whole == pytest.approx(factor, rel=0.05), mode
    four = ranks[0][1]  # one stage over 4 replicas: sharding saves a quarter, or more
    assert four["fsdp"]["within_step"] / four["replicate"]["within_step"] == pytest.approx(0.75)
    assert four["fsdp-reshard"]["within_step"] / four["replicate"]["within_step"] == \
        pytest.approx(0.5625)


def test_the_collectives_are_zero_alone_and_on_the_step_with_replicas(ranks: Figures) -> None:
    for shape, run in _each(ranks):
        if "alone" in run:
            assert run["alone"]["collective_seconds"] == (0.0,) * shape[0]
            assert run["alone"]["outside"] == 0.0  # the timeline is the simulated actions'
        for mode, figures in run.items():
            if mode == "alone":
                continue
            gathers, reduces = figures["gathers"], figures["reduces"]
            assert min(reduces) > 0, (shape, mode)
            if mode == "replicate":
                assert gathers == (0,) * shape[0] and figures["collective_seconds"] == reduces
            elif mode == "fsdp":  # one all-gather and one reduce-scatter per unit
                assert gathers == pytest.approx(reduces)
                assert figures["collective_seconds"] == pytest.approx(
                    tuple(2 * r for r in reduces))
            else:  # 1F1B, 4 micro-batches: gathered for each forward and each backward
                assert figures["collective_seconds"] == pytest.approx(
                    tuple(9 * r for r in reduces))
            # Outside the actions: the gathers once per step on micro-batch 0's way, and a
            # stage's reduction after its last action.
            first = sum(gathers) if mode == "fsdp" else 0.0
            low, high = first + min(reduces), first + max(reduces)
            assert low * (1 - TOLERANCE) <= figures["outside"] <= high * (1 + TOLERANCE), \
                (shape, mode, figures["outside"], low, high)


def test_predict_leaves_the_shards_as_they_were(ranks: Figures) -> None:
    for shape, run in _each(ranks):
        for mode, figures in run.items():
            assert figures["untouched"], (shape, mode)
            assert figures["left_gathered"] == 0, (shape, mode)
            assert figures["stepped"], (shape, mode)
            if mode.startswith("fsdp"):
                assert figures["public"] > 0, (shape, mode)


# -- the pure formulas -------------------------------------------------------------------------


def test_a_ring_moves_all_but_a_replica_share_and_waits_once_per_step() -> None:
    link = Link(latency=1e-5, bandwidth=1e9)
    assert ring_seconds(8e6, 4, link) == pytest.approx(3 * (1e-5 + 2e6 / 1e9))
    assert ring_seconds(8e6, 1, link) == 0.0
    assert ring_seconds(0.0, 4, link) == 0.0


def test_a_split_schedule_keeps_units_gathered_from_i_to_the_next_forward() -> None:
    for per_chunk in gathers_per_action(get_schedule("1f1b", 2, 4)):
        assert per_chunk == {Op.F: 1.0, Op.B: 1.0, Op.I: 0.0}
    # Stage 0 runs F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3: F0 and F1 gather, F2 and F3 find
    # the units kept by the I before them; I0 to I2 gather (a forward freed them), I3
    # finds them kept by I2.
    first, second = gathers_per_action(get_schedule("zb-h1", 2, 4))
    assert first == {Op.F: 0.5, Op.B: 0.0, Op.I: 0.75}
    assert second == {Op.F: 0.25, Op.B: 0.0, Op.I: 1.0}


def test_gathered_bytes_are_every_unit_or_the_largest() -> None:
    assert gathered_bytes([1.0, 3.0, 2.0], False, False) == 6.0
    assert gathered_bytes([1.0, 3.0, 2.0], True, False) == 3.0
    assert gathered_bytes([1.0, 3.0, 2.0], True, True) == 6.0  # kept from I to W
    assert sharded_fixed_bytes(8.0, ADAM, [4.0, 4.0], DataParallelism(4), False) == 32.0


def test_no_collectives_leave_a_timeline_as_it_is() -> None:
    schedule = get_schedule("1f1b", 2, 4)
    costs = Costs(activation_bytes=1.0)
    timeline = simulate(schedule, costs=costs)
    assert with_step_collectives(timeline, costs, schedule, StepCollectives()) is timeline
    later = with_step_collectives(timeline, costs, schedule, StepCollectives(2.0, (1.0, 0.5)))
    assert later.makespan == timeline.makespan + 2.0 + 1.0  # stage 0 ends the step
    assert later.peak_bytes == timeline.peak_bytes


def test_replicas_are_checked() -> None:
    with pytest.raises(ValueError, match="replicas"):
        DataParallelism(0)
    with pytest.raises(ValueError, match="reshard_after_forward"):
        DataParallelism(2, reshard_after_forward=True)
    with pytest.raises(TypeError, match="DataParallelism"):
        plan([LayerCost(1.0, 2.0)] * 2, stages=2, batch=2,
             data_parallel=4)  # type: ignore[arg-type]


# -- partitioners.plan -------------------------------------------------------------------------

PARAMETERS = 1_000_000  # bytes per layer
LINK = Link(latency=1e-5, bandwidth=1e9)


def _plan(data_parallel: DataParallelism | None, memory_limit: float | None = None) -> Any:
    """Eight equal layers holding parameters and no activations, on 2 stages (4 layers each),
    1F1B over 4 micro-batches, Adam: peak memory is the fixed bytes alone."""
    layers = [LayerCost(forward=1e-3, backward=2e-3, param_bytes=PARAMETERS)] * 8
    return plan({1: layers}, stages=2, batch=4, memory_limit=memory_limit, hop=LINK,
                microbatch_counts=[4], schedules=["1f1b"], checkpoints=["never"],
                optimizer_factor=ADAM, data_parallel=data_parallel)


def test_the_plan_without_replicas_is_what_it_was() -> None:
    plain = _plan(None)
    for same in (_plan(DataParallelism()), _plan(DataParallelism(1, sharded=True))):
        assert same.step_time == plain.step_time and same.peak_memory == plain.peak_memory
        assert same.predicted.events == plain.predicted.events
    assert plain.peak_memory == (4 * (2 + ADAM) * PARAMETERS,) * 2


def test_four_shards_hold_a_quarter_of_the_parameters_gradients_and_optimizer_state() -> None:
    alone = max(_plan(None).peak_memory)  # 4 layers x (parameters, gradients, Adam's two)
    stage = 4 * PARAMETERS
    for reshard, gathered in ((False, stage), (True, PARAMETERS)):
        sharded = _plan(DataParallelism(4, sharded=True, reshard_after_forward=reshard))
        # Beside the shards: whole gradients, and the parameters gathered at once.
        assert max(sharded.peak_memory) - stage - gathered == pytest.approx(alone / 4)
    assert _plan(DataParallelism(4)).peak_memory == _plan(None).peak_memory  # whole copies


def test_a_memory_limit_only_shards_fit_is_met_only_with_fsdp() -> None:
    limit = 13 * PARAMETERS  # alone or replicated 16; sharded over 4: 4 + 4 + 4 = 12
    for data_parallel in (None, DataParallelism(4)):
        with pytest.raises(MemoryLimitError):
            _plan(data_parallel, limit)
    fits = _plan(DataParallelism(4, sharded=True), limit)
    assert fits.fits and max(fits.peak_memory) <= limit


def test_the_planned_step_pays_the_replicas_collectives() -> None:
    plain = _plan(None).step_time
    unit = ring_seconds(PARAMETERS, 4, LINK)
    replicated = _plan(DataParallelism(4)).step_time - plain
    assert replicated == pytest.approx(4 * 2 * unit)  # each stage all-reduces 4 layers
    sharded = _plan(DataParallelism(4, sharded=True)).step_time - plain
    assert sharded == pytest.approx(8 * unit + 4 * unit)  # 8 gathers first, 4 reduced last
    resharded = _plan(DataParallelism(4, sharded=True, reshard_after_forward=True)).step_time
    assert resharded - plain > sharded  # every forward and backward gathers again
    own_link = _plan(DataParallelism(4, sharded=True, link=Link(1e-5, 1e8))).step_time
    assert own_link - plain > sharded  # a slower link between replicas
