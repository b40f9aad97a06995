"""Every registered schedule's timetable, comm plans, makespans and peaks at P 1-8, M 1-16 are
the ones recorded in ``data/reference_table.json.gz`` (written before timetables became arrays,
issue 43), so a change of representation cannot change a single action.

Regenerate only for an intended change of a generator, and say why in the commit:

    .venv/bin/python tests/schedules/test_reference_table.py --write
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from schedules import Costs, ScheduleError, comm_plan, get_schedule, schedule_names, simulate
from schedules import validate, validate_comm
from schedules.forward import forward_only

TABLE = Path(__file__).resolve().parent / "data" / "reference_table.json.gz"
STAGES = range(1, 9)
MICROBATCHES = range(1, 17)
# Non-default options worth pinning, beside every schedule's defaults.
VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("interleaved-1f1b", {"chunks_per_stage": 1}),
    ("interleaved-1f1b", {"chunks_per_stage": 3}),
    ("zb", {"max_inflight": 1}),
    ("zb", {"max_inflight": 6}),
    ("zb", {"max_inflight": 12}),
    ("dualpipe-v", {"overlap": True}),  # the overlapped F&B pairs (issue 42)
)
# Costs with bytes, hops and recomputation, so that every term of the simulator counts.
RICH = Costs.from_stages(forward=1.0, backward=2.0, weight=1.0, comm=0.25,
                         activation_bytes=3.0, input_bytes=1.0, weight_bytes=1.5,
                         fixed_bytes=10.0, recompute="except_last",
                         exchange=0.25)  # what overlapped pairs hide (none elsewhere)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _events(timeline: Any) -> str:
    """Every event as text, in stage order then start: what a replay must reproduce."""
    rows = sorted((event.stage, event.start, event.end, str(event.action))
                  for event in timeline.events)
    return "\n".join(f"{stage} {start!r} {end!r} {action}" for stage, start, end, action in rows)


def record(name: str, stages: int, microbatches: int, options: dict[str, Any]) -> dict[str, Any]:
    """What one generator gives for one pair: its timetable, plans and figures, or its refusal."""
    try:
        schedule = get_schedule(name, stages, microbatches, **options)
    except (ScheduleError, ValueError) as error:
        return {"refused": f"{type(error).__name__}: {error}"}
    validate(schedule)
    plan = comm_plan(schedule)
    validate_comm(plan)
    plain = simulate(schedule, forward=1.0, backward=2.0, weight=1.0)
    rich = simulate(schedule, costs=RICH)
    inference = forward_only(schedule)
    return {
        "timetable": str(schedule),
        "placement": list(schedule.placement),
        "comm_plan": str(plan),
        "comm_plans": {strategy: _digest(str(comm_plan(schedule, strategy)))
                       for strategy in ("ordered", "paired", "naive")},
        "forward_only_plan": _digest(str(comm_plan(inference))),
        "makespan": plain.makespan,
        "bubble_fraction": plain.bubble_fraction,
        "peak_activations": list(plain.peak_activations),
        "events": _digest(_events(plain)),
        "rich_makespan": rich.makespan,
        "rich_makespan_bound": rich.makespan_bound,
        "rich_peak_bytes": list(rich.peak_bytes or ()),
        "rich_events": _digest(_events(rich)),
    }


def cases() -> list[tuple[str, str, int, int, dict[str, Any]]]:
    """``(key, name, stages, microbatches, options)`` for every recorded pair."""
    found = []
    for name, options in [(name, {}) for name in schedule_names()] + list(VARIANTS):
        suffix = "".join(f" {key}={value}" for key, value in sorted(options.items()))
        for stages in STAGES:
            for microbatches in MICROBATCHES:
                key = f"{name}{suffix} P={stages} M={microbatches}"
                found.append((key, name, stages, microbatches, options))
    return found


def build() -> dict[str, dict[str, Any]]:
    return {key: record(name, stages, microbatches, options)
            for key, name, stages, microbatches, options in cases()}


def _load() -> dict[str, dict[str, Any]]:
    with gzip.open(TABLE, "rt", encoding="utf-8") as file:
        return json.load(file)  # type: ignore[no-any-return]


def _groups() -> list[str]:
    return [name + "".join(f" {k}={v}" for k, v in sorted(options.items()))
            for name, options in [(name, {}) for name in schedule_names()] + list(VARIANTS)]


@pytest.mark.parametrize("group", _groups())
def test_every_pair_matches_the_reference(group: str) -> None:
    reference = _load()
    for key, name, stages, microbatches, options in cases():
        if not key.startswith(group + " P="):
            continue
        assert key in reference, f"{key} is not in the reference table"
        got, want = record(name, stages, microbatches, options), reference[key]
        for field in sorted(set(got) | set(want)):
            assert got.get(field) == want.get(field), f"{key}: {field} differs"


def test_the_reference_covers_every_registered_schedule() -> None:
    reference = _load()
    assert sorted(reference) == sorted(key for key, *_ in cases())


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(__doc__)
    TABLE.parent.mkdir(exist_ok=True)
    text = json.dumps(build(), sort_keys=True, separators=(",", ":"))
    with gzip.GzipFile(TABLE, "wb", compresslevel=9, mtime=0) as file:
        file.write(text.encode("utf-8"))
    print(f"{TABLE}: {TABLE.stat().st_size} bytes, {len(text)} characters of JSON")
