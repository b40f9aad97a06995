"""Profiling, balancing, planning and predicting see a traced model's units as layers."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

import torch

from partitioners import profile
from pipeline import Pipe, Sample
from traced_models import build, loss_options, reference

TOLERANCE = 1e-10


def _worst(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> float:
    return max((p.grad - expected[name]).abs().max().item()
               for name, p in model.named_parameters(remove_duplicate=False))


def test_profile_measures_every_unit_from_the_batch_as_the_model_takes_it() -> None:
    model, batch, target = build("llama")
    with Pipe(model, chunks=2, sample=batch, devices=["cpu", "cpu"],
              **loss_options("llama")) as pipe:
        costs = profile(pipe.model, batch, microbatches=2, warmup=0, repeat=1,
                        loss_fn=pipe.loss_fn, target=target)
        assert len(costs) == len(pipe.units)
        assert all(cost.forward > 0 and cost.backward > 0 for cost in costs)
        # every parameter counted once, the tied head included
        assert sum(cost.param_bytes for cost in costs) == sum(
            p.numel() * p.element_size() for p in model.parameters())


def test_time_balance_measured_memory_and_predict() -> None:
    model, batch, target = build("gpt2")
    expected_loss, expected = reference(copy.deepcopy(model), batch, target, "gpt2")
    with Pipe(model, chunks=2, balance="time", sample=batch, devices=["cpu", "cpu"],
              **loss_options("gpt2")) as pipe:
        assert sum(pipe.balance) == len(pipe.units) and all(b >= 1 for b in pipe.balance)
        predicted = pipe.predict(batch, target)
        model.zero_grad()
        with pipe.measure_memory():
            loss = pipe.step(batch, target)
        assert predicted.makespan > 0 and len(predicted.events) == len(pipe.timeline.events)
        assert [report.peak_activations for report in pipe.memory] == [2.0, 1.0]  # 1F1B
    assert abs(loss.item() - expected_loss) < TOLERANCE
    assert _worst(model, expected) < TOLERANCE


def test_auto_plans_a_traced_model_and_stays_exact() -> None:
    model, batch, target = build("looped")
    expected_loss, expected = reference(copy.deepcopy(model), batch, target, "looped")
    with Pipe(model, chunks="auto", schedule="auto", sample=Sample(batch, target),
              devices=["cpu", "cpu"], memory_limit=2**30, **loss_options("looped")) as pipe:
        assert pipe.plan is not None and sum(pipe.balance) == len(pipe.units)
        model.zero_grad()
        loss = pipe.step(batch, target)
    assert abs(loss.item() - expected_loss) < TOLERANCE
    assert _worst(model, expected) < TOLERANCE


def _deferring_targets(cut: Any) -> set[str]:
    return {getattr(node.target, "__name__", str(node.target)) for unit in cut.units
            for graph in unit.graphs for node in graph.graph.nodes
            if node.op == "call_function" and node.target.__module__.startswith("split_backward")}


def test_the_command_and_the_pipe_cut_and_price_one_way(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """pipe-balance and Pipe take one cut (traced Linear products pointed at the deferring
    functions in both), and the split mode asked for is the one the plan priced."""
    from partitioners.cli.command import main
    from partitioners.measure.model_cut import cut_of

    model, batch, target = build("looped")
    assert _deferring_targets(cut_of(model, batch)) == {"linear"}
    with Pipe(model, chunks=2, schedule="auto", sample=Sample(batch, target),
              devices=["cpu", "cpu"], split_backward="graph", **loss_options("looped")) as pipe:
        assert _deferring_targets(pipe.cut) == {"linear"}
        assert pipe.plan.split_backward == "graph"
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "partitioners" / "cli"))
    monkeypatch.chdir(tmp_path)
    status = main(["cli_factories:mlp", "--input-shape", "8,32", "--stages", "2",
                   "--schedule", "auto", "--chunks", "2", "--threads", "1", "--repeat", "1",
                   "--warmup", "0", "--no-progress", "--split-backward", "graph",
                   "--json", "o.json"])
    assert status == 0
    data = json.loads((tmp_path / "o.json").read_text())
    assert data["split_backward"] == data["options"]["split_backward"] == "graph"
