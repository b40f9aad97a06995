"""pipe-balance tells the truth: a cut "by time" for a schedule whose simulated step is never
slower than the uniform cut printed beside it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from partitioners.cli.command import main
from partitioners.measure.cost import LayerCost, Profile

HERE = Path(__file__).absolute().parent

# min-max cuts [1, 2] (slowest stage 19 s against 21 s), whose 1F1B step with two
# micro-batches is 48 s; the uniform cut [2, 1] takes 45 s.
DISAGREE = [LayerCost(9.0, 1.0, name="Linear"), LayerCost(7.0, 4.0, name="Linear"),
            LayerCost(7.0, 1.0, name="Linear")]


def test_by_time_is_never_slower_than_the_uniform_cut_it_shows(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    def measured(*args: Any, **kwargs: Any) -> Profile:
        return Profile(DISAGREE)

    monkeypatch.setattr("partitioners.measure.profile.profile", measured)
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.chdir(tmp_path)
    status = main(["cli_factories:three", "--input-shape", "2,4", "--stages", "2",
                   "--chunks", "2", "--schedule", "1f1b", "--no-progress", "--json", "o.json"])
    out = capsys.readouterr().out
    assert status == 0
    data = json.loads((tmp_path / "o.json").read_text())
    chosen, even = data["predicted"]["step_time_ms"], data["uniform"]["predicted"]["step_time_ms"]
    assert chosen <= even, out
    assert data["balance"] == [2, 1]
    assert data["chosen_by"] == {"searched": 2, "exhaustive": True, "min_max": [1, 2]}
    assert "fastest simulated step of all 2 cuts" in out

