"""Pipe.predict and its parts: the calibration, the chunk probes, the predicted step."""

from __future__ import annotations

import math
import statistics
from typing import Any

import pytest
import torch
from torch import nn

from pipeline import Pipe
from pipeline.compute.microbatch import split_batch
from pipeline.group.hops import HopModel
from pipeline.group.links import calibrate_local, fit_link, hop_pairs
from pipeline.predict.fixed_bytes import optimizer_state_bytes
from pipeline.predict.overheads import action_overhead
from pipeline.predict.step import predict_step
from schedules import Link, get_schedule

from dist_harness import in_turn, run_ranks
from predict_workers import (
    batch,
    bn_mlp,
    calibrated_links,
    changed,
    predict_missing_target,
    predict_untouched,
    snapshot,
)


def mlp(widths: list[int], seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for inputs, outputs in zip(widths, widths[1:]):
        layers += [nn.Linear(inputs, outputs), nn.Tanh()]
    return nn.Sequential(*layers)


# -- calibration ------------------------------------------------------------------------------


def test_fit_link_through_two_points() -> None:
    link = fit_link(1e-4, 1e-4 + (2**20 - 64) / 1e9)
    assert link.bandwidth == pytest.approx(1e9)
    assert link.latency == pytest.approx(1e-4 - 64 / 1e9)


def test_fit_link_stays_positive_and_finite() -> None:
    link = fit_link(2e-4, 1e-4)  # the large message was faster: noise
    assert link.latency > 0 and math.isfinite(link.bandwidth) and link.bandwidth > 0


def test_hop_pairs_follow_the_placement() -> None:
    assert hop_pairs(get_schedule("1f1b", 3, 4)) == [(0, 1), (1, 2)]
    assert hop_pairs(get_schedule("zb-v", 2, 4)) == [(0, 1)]  # 0 -> 1 -> 1 -> 0


def test_calibrate_local_gives_a_positive_latency_and_a_finite_bandwidth() -> None:
    hops = calibrate_local([torch.device("cpu")] * 2, get_schedule("1f1b", 2, 4), 10.0)
    link = hops.link(0, 1)
    assert link.latency > 0 and math.isfinite(link.bandwidth) and link.bandwidth > 0
    assert hops(0, 1, 1e6) > hops(0, 1, 0) > 0
    assert hops(1, 1, 1e6) == 0.0


def test_hop_model_names_a_pair_it_lacks() -> None:
    with pytest.raises(ValueError, match="no calibrated link from stage 0 to stage 2"):
        HopModel(((0, 1, Link(1e-5, 1e9)),)).link(0, 2)


def test_action_overhead_is_small_and_leaves_the_rng() -> None:
    state = torch.get_rng_state()
    overhead = action_overhead(torch.device("cpu"))
    assert 0 <= overhead < 0.01
    assert torch.equal(state, torch.get_rng_state())


# -- predicting in one process ------------------------------------------------------------------


def test_predict_does_not_train_in_one_process() -> None:
    model = bn_mlp()
    pipe = Pipe(model, chunks=4, balance=[3, 3], devices=["cpu", "cpu"], schedule="zb-h1",
                checkpoint="except_last", loss_fn=nn.CrossEntropyLoss())
    x, y = batch()
    optimizer = torch.optim.Adam(model.parameters())
    pipe.step(x, y)
    optimizer.step()
    pipe.step(x, y)
    before = snapshot(model, optimizer)
    pipe.predict(x, y, optimizer=optimizer)
    assert changed(before, snapshot(model, optimizer)) == []


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v"])
def test_predicted_structure(schedule: str) -> None:
    per_stage = 2 if schedule in ("interleaved-1f1b", "zb-v") else 1
    stages, microbatches = 4, 8
    model = mlp([32] * (2 * stages * per_stage + 1))
    pipe = Pipe(model, chunks=microbatches, stages=stages, devices=["cpu"] * stages,
                schedule=schedule, checkpoint="never", loss_fn=nn.MSELoss())
    x, y = torch.randn(32, 32), torch.randn(32, 32)
    timeline = pipe.predict(x, y)
    for stage in range(stages):
        assert timeline.stage_order(stage) == pipe.schedule.order[stage]
    assert timeline.makespan > 0
    assert timeline.peak_bytes is not None and all(p > 0 for p in timeline.peak_bytes)
    if schedule in ("gpipe", "1f1b"):
        # Equal chunks after the first (whose input, the caller's batch, is not counted):
        # the bytes held follow the micro-batches held at once.
        prediction = predict_step(pipe._runner, *split_batch(x, y, microbatches, True))
        held = prediction.timeline.peak_activations
        activations = prediction.peak_activation_bytes
        for a in range(1, stages):
            for b in range(1, stages):
                if held[a] > held[b]:
                    assert activations[a] > activations[b], (held, activations)


def test_the_optimizer_state_is_counted() -> None:
    model = mlp([16, 16, 16])
    pipe = Pipe(model, chunks=2, balance=[2, 2], devices=["cpu", "cpu"], schedule="1f1b",
                loss_fn=nn.MSELoss())
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    plain = pipe.predict(x, y).peak_bytes
    adam = pipe.predict(x, y, optimizer=torch.optim.Adam(model.parameters())).peak_bytes
    assert plain is not None and adam is not None
    for stage in range(2):
        params = sum(p.numel() * p.element_size() for p in model[2 * stage].parameters())
        assert adam[stage] - plain[stage] == pytest.approx(2 * params)
    momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert optimizer_state_bytes(momentum, list(model[0].parameters())) == sum(
        p.numel() * 4 for p in model[0].parameters())


def test_a_heavier_chunk_shifts_the_prediction() -> None:
    torch.set_num_threads(1)
    x, y = torch.randn(64, 64), torch.randn(64, 64)

    def predicted(hidden: int) -> tuple[float, tuple[float, ...]]:
        # Stage 1 carries a block of width ``hidden``; stage 0 stays 64 wide.
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, hidden), nn.Tanh(),
                              nn.Linear(hidden, 64))
        pipe = Pipe(model, chunks=4, balance=[2, 3], devices=["cpu", "cpu"], schedule="1f1b",
                    checkpoint="never", loss_fn=nn.MSELoss())
        timeline = pipe.predict(x, y)
        return timeline.makespan, timeline.busy

    light, heavy = predicted(64), predicted(8192)  # 128x the multiply-adds of stage 1
    assert heavy[0] > light[0]
    assert heavy[1][1] / heavy[1][0] > 2 * light[1][1] / light[1][0]


def test_predict_needs_x_and_target_in_one_process() -> None:
    pipe = Pipe(mlp([8, 8, 8]), chunks=2, balance=[2, 2], devices=["cpu", "cpu"],
                loss_fn=nn.MSELoss())
    with pytest.raises(ValueError, match="needs x and target in one process"):
        pipe.predict(torch.randn(4, 8), None)
    without_loss = Pipe(mlp([8, 8, 8]), chunks=2, balance=[2, 2], devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="needs a loss_fn"):
        without_loss.predict(torch.randn(4, 8), torch.randn(4, 8))


def test_uneven_microbatches_scale_the_costs() -> None:
    pipe = Pipe(mlp([8, 8, 8]), chunks=3, balance=[2, 2], devices=["cpu", "cpu"],
                loss_fn=nn.MSELoss())
    prediction = predict_step(pipe._runner, *split_batch(torch.randn(8, 8), torch.randn(8, 8),
                                                         3, True))
    assert prediction.costs.microbatch_scale == pytest.approx((1.0, 1.0, 2 / 3))


def test_hops_are_calibrated_by_the_first_prediction_and_kept() -> None:
    """Building a Pipe measures no hop; its Ranks calibrate them when predict() first asks,
    and every later prediction charges the same ones."""
    pipe = Pipe(mlp([8, 8, 8]), chunks=2, balance=[2, 2], devices=["cpu", "cpu"],
                loss_fn=nn.MSELoss())
    assert not hasattr(pipe._runner, "hops")
    batch = split_batch(torch.randn(4, 8), torch.randn(4, 8), 2, True)
    first = predict_step(pipe._runner, *batch, ranks=pipe.ranks).hops
    second = predict_step(pipe._runner, *batch, ranks=pipe.ranks).hops
    assert first is second is pipe.ranks.hops(pipe.devices, pipe.schedule)
    assert first.link(0, 1).latency > 0 and first.link(1, 0).bandwidth > 0


# -- predicting on 2 gloo ranks -----------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """One spawn of 2 ranks for every 2-rank test (each spawn costs seconds), the rank
    functions in turn: per rank, each result by name. The calibration runs first, in a
    fresh process as alone; the call that fails on purpose, last."""
    calls = {
        "calibrated": (calibrated_links, ()),
        "1f1b": (predict_untouched, ("1f1b",)),
        "zb-v": (predict_untouched, ("zb-v",)),
        "missing_target": (predict_missing_target, ()),
    }
    return [dict(zip(calls, results)) for results in run_ranks(in_turn, 2, list(calls.values()))]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_predict_agrees_on_every_rank_and_does_not_train(
        two_ranks: list[dict[str, Any]], schedule: str) -> None:
    results = [found[schedule] for found in two_ranks]
    for rank, result in enumerate(results):
        assert result["changed"] == [], f"rank {rank} changed {result['changed']}"
        assert result["makespan"] > 0
        assert all(link[2] > 0 and math.isfinite(link[3]) for link in result["links"])
    assert results[0]["events"] == results[1]["events"]
    assert results[0]["peak_bytes"] == results[1]["peak_bytes"]


def test_a_missing_target_fails_on_every_rank(two_ranks: list[dict[str, Any]]) -> None:
    messages = [found["missing_target"] for found in two_ranks]
    assert all("target" in message for message in messages), messages


def _linear_pipe() -> tuple[Pipe, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    pipe = Pipe(model, chunks=4, balance=[2, 4], devices=["cpu", "cpu"],
                loss_fn=torch.nn.MSELoss())
    return pipe, torch.randn(16, 32), torch.randn(16, 32)


def test_after_a_step_each_stage_computes_as_long_as_it_was_measured_to() -> None:
    pipe, x, y = _linear_pipe()
    before = pipe.predict(x, y)
    pipe.step(x, y)
    measured = pipe.timeline
    refined = pipe.predict(x, y)
    for stage in range(2):
        assert refined.busy[stage] == pytest.approx(measured.busy[stage], rel=1e-9)
    assert refined.busy != before.busy


def test_after_several_steps_each_stage_computes_its_median_measured_busy_time() -> None:
    from pipeline.runtime.runner import RECENT_STEPS

    pipe, x, y = _linear_pipe()
    measured = []
    for _ in range(RECENT_STEPS + 2):  # the oldest two fall out
        pipe.step(x, y)
        measured.append(pipe.timeline)
    refined = pipe.predict(x, y)
    for stage in range(2):
        median = statistics.median(t.busy[stage] for t in measured[-RECENT_STEPS:])
        assert refined.busy[stage] == pytest.approx(median, rel=1e-9)


def test_a_send_costs_the_sending_action_not_the_hop() -> None:
    from pipeline.group.hops import HopModel
    from pipeline.predict.overheads import refined
    from pipeline.predict.fixed_bytes import FixedBytes
    from pipeline.predict.step import build_costs
    from pipeline.predict.probe import ChunkCosts

    schedule = get_schedule("1f1b", 2, 4)
    chunks = {c: ChunkCosts(chunk=c, forward=1.0, backward=2.0, input_grad=0.0, weight_grad=0.0,
                            recompute_forward=1.0, recompute_backward=3.0,
                            recompute_input_grad=0.0, saved_bytes=10,
                            input_bytes=0 if c == 0 else 100, output_bytes=100 if c == 0 else 0)
              for c in range(2)}
    hop = Link(latency=0.5, bandwidth=1000.0)
    send = Link(latency=0.25, bandwidth=400.0)  # 0.25 + 100 / 400 = 0.5 s a send
    hops = HopModel(((0, 1, hop), (1, 0, hop)), "test", ((0, 1, send), (1, 0, send)))
    fixed = {s: FixedBytes(0, 0, 0, 0) for s in range(2)}
    costs = build_costs(schedule, chunks, (0.0, 0.0), fixed, hops, [8] * 4, "never")
    assert list(costs.forward) == [1.5, 1.0]  # chunk 0 sends its output on
    assert list(costs.backward) == [2.0, 2.5]  # chunk 1 sends its input's gradient back
    # A measured hop of 1.2 s after the producer's event: 0.1 s of bandwidth and 0.5 s of
    # sending come off, the latency is what remains.
    assert refined(hops, 1.2, 100).link(0, 1).latency == pytest.approx(0.6)
    assert refined(hops, 1.2, 100).senders == hops.senders


def test_calibrating_across_ranks_measures_what_a_send_costs_its_sender(
        two_ranks: list[dict[str, Any]]) -> None:
    links = [found["calibrated"] for found in two_ranks]
    assert links[0] == links[1]
    (source, destination, latency, bandwidth), = links[0]["senders"][:1]
    assert (source, destination) == (0, 1) and 0 < latency < 0.1 and bandwidth > 0
