"""bench_vs_torch on the ranks: the runners (each a fresh model, one step per call) and each
rank's measurements of them, per M; ``TorchStage`` also serves bench_plan --ranks 2."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from _rounds import measure_rounds, median_ms, timed_between_barriers
from _vs_torch_model import STAGES, make_batch, make_model

if TYPE_CHECKING:
    from schedules.recompute import CheckpointMode


def _grad_sq(parameters: Iterable[Any]) -> float:
    """The squared norm of the gradients, to check a pipeline against one process."""
    return sum((float(p.grad.double().pow(2).sum()) for p in parameters if p.grad is not None),
               0.0)


class OneProcess:
    """The whole model in this process, M micro-batches with gradient accumulation."""

    def __init__(self, microbatches: int) -> None:
        import torch

        self.model = make_model()
        x, y = make_batch()
        self.xs, self.ys = torch.tensor_split(x, microbatches), torch.tensor_split(y, microbatches)
        self.microbatches = microbatches

    def step(self) -> None:
        from torch import nn

        self.model.zero_grad(set_to_none=True)
        for x, y in zip(self.xs, self.ys, strict=True):
            loss = nn.functional.mse_loss(self.model(x), y) / self.microbatches
            loss.backward()  # type: ignore[no-untyped-call]

    def grad_sq(self) -> float:
        return _grad_sq(self.model.parameters())


class Ours:
    """Our Pipe, one stage per rank."""

    def __init__(self, rank: int, microbatches: int, schedule: str,
                 checkpoint: CheckpointMode) -> None:
        import torch.distributed as dist
        from torch import nn

        from pipeline import Pipe

        self.pipe = Pipe(make_model(), chunks=microbatches, schedule=schedule,
                         checkpoint=checkpoint, loss_fn=nn.MSELoss(), group=dist.group.WORLD)
        x, y = make_batch()
        self.x = x if rank == 0 else None
        self.y = y if rank == STAGES - 1 else None
        self.makespans: list[float] = []

    def step(self) -> None:
        self.pipe.zero_grad()
        self.pipe.step(self.x, self.y)

    def after_step(self) -> None:
        """Outside the timed step: reading the timeline waits for its background gather."""
        if self.pipe.timeline is not None:
            self.makespans.append(self.pipe.timeline.makespan)

    def grad_sq(self) -> float:
        return _grad_sq(self.pipe.parameters())


class OursThreads:
    """Our Pipe in one process, a thread per stage (rank 0 only; the other rank idles)."""

    def __init__(self, microbatches: int, schedule: str) -> None:
        from torch import nn

        from pipeline import Pipe

        self.pipe = Pipe(make_model(), chunks=microbatches, schedule=schedule,
                         checkpoint="never", loss_fn=nn.MSELoss(), devices=["cpu"] * STAGES)
        self.x, self.y = make_batch()

    def step(self) -> None:
        self.pipe.zero_grad()
        self.pipe.step(self.x, self.y)

    def grad_sq(self) -> float:
        return _grad_sq(self.pipe.parameters())


class TorchStage:
    """torch.distributed.pipelining: ``module`` (this rank's layers) in a PipelineStage, run
    by ScheduleGPipe or Schedule1F1B; rank 0 feeds the batch, the last rank the targets."""

    def __init__(self, module: Any, rank: int, microbatches: int, schedule: str,
                 loss_fn: Any, batch: tuple[Any, Any]) -> None:
        import torch
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.module = module
        stage = PipelineStage(module, rank, STAGES, torch.device("cpu"))
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        self.schedule = kind(stage, microbatches, loss_fn=loss_fn)
        self.rank = rank
        self.x, self.y = batch

    def step(self) -> None:
        self.module.zero_grad(set_to_none=True)
        if self.rank == 0:
            self.schedule.step(self.x)
        else:
            self.schedule.step(target=self.y, losses=[])

    def grad_sq(self) -> float:
        return _grad_sq(self.module.parameters())


class Torch(TorchStage):
    """torch.distributed.pipelining on this rank's half of the benchmark's model."""

    def __init__(self, rank: int, microbatches: int, schedule: str) -> None:
        from torch import nn

        model = make_model()
        per_stage = len(model) // STAGES
        half = copy.deepcopy(model[rank * per_stage:(rank + 1) * per_stage])
        super().__init__(half, rank, microbatches, schedule, nn.MSELoss(), make_batch())


class Idle:
    """Rank 1's part while rank 0 runs OneProcess alone: nothing (it waits in the barrier)."""

    def step(self) -> None:
        return None


def rank_main(rank: int, world: int, counts: list[int], warmup: int, steps: int, rounds: int,
              seconds: float, load: Any) -> dict[str, Any]:
    """Every measurement of this rank: per M, each runner's steps as (start, end) times."""
    import torch
    import torch.distributed as dist

    from pipeline import keep_freed_pages

    torch.set_num_threads(1)
    keep_freed_pages()  # host memory kept between actions, both runtimes alike
    report: dict[str, Any] = {"by_m": {}}
    report["barrier_ms"] = median_ms([end - start for start, end in
                                      (timed_between_barriers(lambda: None) for _ in range(50))])
    whole = OneProcess(1) if rank == 0 else Idle()  # the calibration: ~100 ms wanted
    report["whole_batch_ms"] = median_ms([end - start for start, end in
                                          (timed_between_barriers(whole.step)
                                           for _ in range(8))][2:])
    for microbatches in counts:
        runners: dict[str, Any] = {
            # S(M): rank 0 alone, then both ranks at once (do the two cores slow each other?)
            "single": OneProcess(microbatches) if rank == 0 else Idle(),
            "single, both ranks": OneProcess(microbatches),
        }
        for schedule in ("gpipe", "1f1b"):
            runners[f"ours {schedule}"] = Ours(rank, microbatches, schedule, "never")
            runners[f"ours {schedule} except_last"] = Ours(rank, microbatches, schedule,
                                                           "except_last")
            runners[f"torch {schedule}"] = Torch(rank, microbatches, schedule)
        for runner in runners.values():
            for _ in range(warmup):
                timed_between_barriers(runner.step)
        samples = measure_rounds(rank, runners, steps, rounds, seconds, load)
        grads = {}
        for name, runner in runners.items():
            gathered: list[Any] = [None] * world
            mine = runner.grad_sq() if hasattr(runner, "grad_sq") else 0.0
            dist.all_gather_object(gathered, mine)
            grads[name] = sum(gathered)
        report["by_m"][microbatches] = {
            "samples": samples,
            "makespan_ms": {name: median_ms(r.makespans) for name, r in runners.items()
                            if isinstance(r, Ours) and r.makespans},
            "grad_sq": grads,
        }
    return report
