"""Functions spawned gloo ranks run for tests/pipeline/predict/test_predict_sharded.py.

Each builds Pipes over a device mesh (pipeline stages along ``"pp"``, replicas along
``"dp"``), trains a step with Adam, predicts the next one and returns plain numbers:
bytes predicted and held, the collectives predicted, and whether predict() left the
sharded state as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

WIDTH = 64
CHUNKS = 4
ROWS = 16


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])


def _pipe(mesh: DeviceMesh, mode: str) -> Any:
    """``mode``: ``alone`` (no replicas: each pp group its own pipeline), ``replicate``,
    ``fsdp`` or ``fsdp-reshard`` (``reshard_after_forward=True``)."""
    from pipeline import Distributed, Pipe

    stages = mesh["pp"].size()
    balance = [len(_model()) // stages] * stages
    common: dict[str, Any] = {"balance": balance, "schedule": "1f1b",
                              "checkpoint": "never", "loss_fn": nn.MSELoss(), "timeout": 30.0}
    if mode == "alone":
        return Pipe(_model(), CHUNKS, group=mesh["pp"].get_group(), **common)
    layout = Distributed.from_mesh(mesh, data_parallel=mode.removesuffix("-reshard"),
                                   reshard_after_forward=mode.endswith("-reshard"))
    return Pipe(_model(), CHUNKS, distributed=layout, **common)


def held_bytes(pipe: Any, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds of parameters, gradients and optimizer state (local shards)."""
    tensors = [t for p in pipe.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0]
    return sum(_local(t).nbytes for t in tensors)


def _state(pipe: Any, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    found = [_local(t).clone() for p in pipe.parameters() for t in (p, p.grad) if t is not None]
    return found + [_local(v).clone() for state in optimizer.state.values()
                    for v in state.values() if isinstance(v, torch.Tensor)]


def predicted_and_held(rank: int, world: int,
                       runs: Sequence[tuple[Sequence[int], Sequence[str]]]
                       ) -> list[dict[str, dict[str, Any]]]:
    """``_measured`` for each (mesh shape, modes) in turn."""
    torch.set_num_threads(1)
    return [_measured(rank, shape, modes) for shape, modes in runs]


def _measured(rank: int, shape: Sequence[int], modes: Sequence[str]
              ) -> dict[str, dict[str, Any]]:
    """Per mode, after one step with Adam: this rank's stage, the bytes it holds and those
    predicted for it (between steps, and within a step less receive buffers), the
    collectives predicted (per stage, and how much the timeline grew beyond the simulated
    actions' makespan), whether predict() changed any state or left units gathered,
    ``Pipe.predict``'s makespan (sharded modes), and whether the step after it still ran."""
    from pipeline.compute.microbatch import split_batch
    from pipeline.predict.step import predict_step
    from schedules import simulate

    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=("pp", "dp"))
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(ROWS, WIDTH, generator=generator)
    found: dict[str, dict[str, Any]] = {}
    for mode in modes:
        pipe = _pipe(mesh, mode)
        optimizer = torch.optim.Adam(pipe.parameters(), lr=0.01)
        pipe.step(x, x)
        optimizer.step()
        before = _state(pipe, optimizer)
        prediction = predict_step(pipe._runner, *split_batch(x, x, CHUNKS, False, "predict"),
                                  optimizer=optimizer, ranks=pipe.ranks)
        after = _state(pipe, optimizer)
        stage = pipe._runner.stage
        fixed = prediction.fixed[stage]
        actions_only = simulate(pipe.schedule, costs=prediction.costs).makespan
        collectives = prediction.collectives
        found[mode] = {
            "stage": stage,
            "held": held_bytes(pipe, optimizer),
            "between_steps": fixed.between_steps,
            "within_step": fixed.total - fixed.buffers,
            "gathered": fixed.gathered,
            "unsharded_gradients": fixed.unsharded_gradients,
            "collective_seconds": prediction.collective_seconds,
            "gathers": tuple(sum(s for _, s in c.gathers) for c in collectives),
            "reduces": tuple(c.reduce for c in collectives),
            "outside": prediction.timeline.makespan - actions_only,
            "untouched": len(before) == len(after) and all(
                torch.equal(a, b) for a, b in zip(before, after)),
            "left_gathered": sum(1 for p in pipe.parameters()
                                 if mode.startswith("fsdp") and not isinstance(p, DTensor)),
        }
        if mode.startswith("fsdp"):  # the public path too
            found[mode]["public"] = pipe.predict(x, x, optimizer).makespan
        found[mode]["stepped"] = bool(torch.isfinite(pipe.step(x, x)))
        pipe.close()
    return found
