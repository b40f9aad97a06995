"""The per-stage report of a cut: sums, shares, memory, imbalance and the predicted step."""

from __future__ import annotations

import pytest

from partitioners import LayerCost, LossCost, Profile, held_microbatches
from partitioners.cut.report import comparison_table, layer_types, report, stage_table, to_data


def costs() -> list[LayerCost]:
    return [
        LayerCost(1e-3, 2e-3, param_bytes=100, activation_bytes=40, saved_bytes=10, name="Linear"),
        LayerCost(1e-4, 1e-4, param_bytes=0, activation_bytes=40, saved_bytes=40, name="ReLU"),
        LayerCost(3e-3, 6e-3, param_bytes=300, activation_bytes=8, saved_bytes=40, name="Linear"),
    ]


def test_report_sums_each_stage() -> None:
    held = held_microbatches("1f1b", 2, 4)
    assert held == (2.0, 1.0)
    cut = report(costs(), [2, 1], held, "1f1b", 4)
    first, second = cut.stages
    assert (first.first, first.last, second.first, second.last) == (0, 1, 2, 2)
    assert first.types == ("Linear", "ReLU")
    assert first.forward == pytest.approx(1.1e-3) and first.backward == pytest.approx(2.1e-3)
    assert first.share + second.share == pytest.approx(1.0)
    assert first.send_bytes == 40 and second.send_bytes == 0
    assert first.activation_memory == 2 * 50 and first.memory == 2 * 100 + 100
    assert cut.imbalance == pytest.approx(9e-3 / ((3.2e-3 + 9e-3) / 2))
    # 1F1B, 2 stages, 4 micro-batches: the slow stage runs 4 forwards and 4 backwards,
    # after the first micro-batch crossed stage 0.
    assert cut.step_time == pytest.approx(1.1e-3 + 4 * 9e-3 + 2.1e-3)
    assert 0 < cut.bubble_fraction < 1


def test_bandwidth_adds_send_time_to_all_stages_but_the_last() -> None:
    held = held_microbatches("1f1b", 2, 4)
    cut = report(costs(), [2, 1], held, "1f1b", 4, bandwidth=1e4)
    first, second = cut.stages
    assert first.send_time == pytest.approx(40 / 1e4) and second.send_time == 0
    assert first.cost == pytest.approx(first.time + 4e-3)
    assert "send ms" in stage_table(cut)
    assert "send ms" not in stage_table(report(costs(), [2, 1], held, "1f1b", 4))


def test_tables_and_data() -> None:
    held = held_microbatches("gpipe", 3, 2)
    chosen = report(costs(), [1, 1, 1], held, "gpipe", 2)
    even = report(costs(), [1, 1, 1], held, "gpipe", 2)
    table = stage_table(chosen)
    assert len(table.splitlines()) == 2 + 3 + 2
    assert "Linear" in table and "total" in table
    comparison = comparison_table(chosen, even, "by time")
    assert "imbalance" in comparison and "bubble" in comparison and "uniform" in comparison
    data = to_data(chosen)
    assert list(data)[:2] == ["balance", "stages"] and data["balance"] == [1, 1, 1]
    assert data["predicted"]["microbatches"] == 2


def test_layer_types_compress_runs_and_truncate() -> None:
    assert layer_types(["Linear", "ReLU", "ReLU"]) == "Linear, ReLU x2"
    long = layer_types(["TransformerEncoderLayer", "LayerNorm", "Linear"], width=20)
    assert len(long) == 20 and long.endswith("...")


def test_layer_names_compress_numbered_runs() -> None:
    """A traced model's units by name: a run of numbered blocks reads as its first and last."""
    names = ["(prologue)", "model.layers.0", "model.layers.1", "model.layers.2"]
    assert layer_types(names) == "(prologue), model.layers.0-2"
    assert layer_types(["model.layers.7", "(epilogue)"]) == "model.layers.7, (epilogue)"
    assert layer_types(["layer1.0", "layer1.1", "layer2.0"]) == "layer1.0-1, layer2.0"
    assert layer_types(["h.1", "h.1", "h.2"]) == "h.1 x2, h.2"
    assert layer_types(["h.1", "h.3"]) == "h.1, h.3"


def test_the_last_stage_runs_the_loss() -> None:
    held = held_microbatches("1f1b", 2, 4)
    plain = report(costs(), [2, 1], held, "1f1b", 4)
    measured = Profile(costs(), loss=LossCost(forward=1e-3, backward=2e-3))
    cut = report(measured, [2, 1], held, "1f1b", 4)
    first, second = cut.stages
    assert first.loss == 0 and second.loss == pytest.approx(3e-3)
    assert second.cost == pytest.approx(second.time + 3e-3)
    assert second.backward == plain.stages[1].backward  # the layers' own times, as before
    # The slow last stage runs 4 forwards and 4 backwards, each now with its loss.
    assert cut.step_time == pytest.approx(plain.step_time + 4 * 3e-3)
    assert "also runs the loss: 3.000 ms" in stage_table(cut)
    assert "also runs the loss" not in stage_table(plain)
    assert to_data(cut)["stages"][1]["loss_ms"] == pytest.approx(3.0)
