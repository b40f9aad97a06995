"""Rank functions for tests/pipeline/runtime/test_timeline_gathers.py (importable by name)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STEPS = 100
PAUSE = 0.05  # seconds the second stage's forwards sleep in the last step only


class Pause(nn.Module):
    """Passes its input on, after sleeping ``pause`` seconds (0: at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.pause = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pause:
            time.sleep(self.pause)
        return x


def _pipe(rank: int) -> tuple[Any, Pause, tuple[torch.Tensor | None, torch.Tensor | None]]:
    from pipeline import Pipe

    torch.manual_seed(0)
    pause = Pause()
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), pause, nn.Linear(8, 8))
    pipe = Pipe(model, chunks=2, balance=[2, 2], schedule="1f1b", loss_fn=nn.MSELoss(),
                group=dist.group.WORLD)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    return pipe, pause, (x if rank == 0 else None, y if rank == 1 else None)


def _steps(pipe: Any, pause: Pause, batch: tuple[Any, Any], steps: int) -> None:
    """``steps`` steps, the second stage's forwards slow in the last one only."""
    for step in range(steps):
        pause.pause = PAUSE if step == steps - 1 else 0.0
        pipe.step(*batch)
    pause.pause = 0.0


def _facts(pipe: Any, timeline: Any) -> dict[str, Any] | None:
    """What the test checks of a timeline: whose events, how many, the slow forwards."""
    if timeline is None:
        return None
    forwards = [e.duration for e in timeline.events if e.stage == 1 and e.action.op.name == "F"]
    return {"stages": sorted({e.stage for e in timeline.events}),
            "events": len(timeline.events),
            "expected": sum(len(order) for order in pipe.schedule.order),
            "slowest_forward": min(forwards)}


def read_once_on_every_rank(rank: int, world: int) -> dict[str, Any]:
    """STEPS steps, then every rank reads pipe.timeline once (twice: the second is kept),
    then close: the gathers counted on this rank after each."""
    torch.set_num_threads(1)
    pipe, pause, batch = _pipe(rank)
    _steps(pipe, pause, batch, STEPS)
    before = pipe._runner.times.gathers
    timeline = pipe.timeline
    again = pipe.timeline
    read = pipe._runner.times.gathers
    runner = pipe._runner
    pipe.close()
    return {"before": before, "read": read, "closed": runner.times.gathers,
            "same": again is timeline, "timeline": _facts(pipe, timeline)}


def read_by_rank_zero_before_close(rank: int, world: int) -> dict[str, Any]:
    """STEPS steps; rank 0 alone reads the timeline, then every rank closes."""
    torch.set_num_threads(1)
    pipe, pause, batch = _pipe(rank)
    _steps(pipe, pause, batch, STEPS)
    runner = pipe._runner
    timeline = pipe.timeline if rank == 0 else None
    pipe.close()
    after = pipe.timeline if rank == 0 else None
    return {"gathers": runner.times.gathers, "timeline": _facts(pipe, timeline),
            "after_close": _facts(pipe, after)}


def predict_then_read(rank: int, world: int) -> dict[str, Any]:
    """Ten steps, predict() on every rank (it gathers the recent steps), then rank 0 reads
    the timeline alone, with no further gather; then the gathers of a step and close."""
    from pipeline.runtime.runner import RECENT_STEPS

    torch.set_num_threads(1)
    pipe, pause, batch = _pipe(rank)
    _steps(pipe, pause, batch, 10)
    runner = pipe._runner
    before = runner.times.gathers
    recent_before = len(runner.times._whole)
    x = torch.randn(4, 8) if rank == 0 else None
    y = torch.randn(4, 8) if rank == 1 else None
    pipe.predict(x, y)
    predicted = runner.times.gathers
    timeline = pipe.timeline if rank == 0 else None
    read = runner.times.gathers
    pipe.step(*batch)
    pipe.close()
    return {"before": before, "recent_before": recent_before, "predicted": predicted,
            "read": read, "closed": runner.times.gathers, "kept": len(runner.times._whole),
            "recent_steps": RECENT_STEPS, "timeline": _facts(pipe, timeline)}
