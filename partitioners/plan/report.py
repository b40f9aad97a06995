"""A Plan as text and as data: the ranked candidates table and JSON for ``pipe-balance``."""

from __future__ import annotations

from typing import Any

from partitioners.plan.search import Candidate, Plan
from partitioners.measure.sizes import format_bytes


def _schedule(candidate: Candidate) -> str:
    options = ",".join(f"{key}={value}" for key, value in candidate.schedule_options.items())
    return f"{candidate.schedule}({options})" if options else candidate.schedule


def _peaks(candidate: Candidate) -> str:
    return " ".join(format_bytes(peak).replace(" ", "") for peak in candidate.peak_memory)


def candidates_table(chosen: Plan, top: int = 10) -> str:
    """The ``top`` best candidates, one per row, then the pick and how many were evaluated."""
    rows = [(str(rank), _schedule(c), str(c.microbatches), str(list(c.balance)), c.checkpoint,
             f"{c.step_time * 1e3:.3f}", f"{c.bubble_fraction:.1%}", _peaks(c),
             "yes" if c.fits else "no")
            for rank, c in enumerate(chosen.candidates[:top], start=1)]
    header = ("#", "schedule", "M", "balance", "checkpoint", "step ms", "bubble",
              "peak memory per stage", "fits")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    right = {0, 2, 5, 6}

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                         for i, (cell, w) in enumerate(zip(cells, widths))).rstrip()

    lines = [line(header), "-" * len(line(header)), *(line(row) for row in rows)]
    limit = "no memory limit" if chosen.memory_limit is None else (
        f"memory limit {format_bytes(chosen.memory_limit)} per stage")
    lines.append(f"(top {len(rows)} of {len(chosen.candidates)} candidates simulated, "
                 f"{limit}; predicted by schedules.simulate)")
    lines.append(f"pick: {chosen.describe()}: step {chosen.step_time * 1e3:.3f} ms, bubble "
                 f"{chosen.bubble_fraction:.1%}, peak {format_bytes(max(chosen.peak_memory))}")
    return "\n".join(lines)


def candidate_data(candidate: Candidate) -> dict[str, Any]:
    """One candidate as JSON-ready data."""
    return {
        "schedule": candidate.schedule,
        "schedule_options": dict(candidate.schedule_options),
        "microbatches": candidate.microbatches,
        "balance": list(candidate.balance),
        "checkpoint": candidate.checkpoint,
        "step_time_ms": candidate.step_time * 1e3,
        "bubble_fraction": candidate.bubble_fraction,
        "peak_memory_bytes": list(candidate.peak_memory),
        "fits": candidate.fits,
    }


def plan_data(chosen: Plan) -> dict[str, Any]:
    """The pick and every candidate, ranked, as JSON-ready data (``pick`` first)."""
    return {
        "pick": candidate_data(chosen),
        "memory_limit": chosen.memory_limit, "split_backward": chosen.split_backward,
        "candidates": [candidate_data(candidate) for candidate in chosen.candidates],
    }
