"""Functions that run inside spawned gloo ranks for tests/pipeline/predict/test_predict.py."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def bn_mlp(width: int = 16) -> nn.Sequential:
    """Six layers with a BatchNorm and a dropout: statistics and RNG use to keep intact."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(),
                         nn.Dropout(0.1), nn.Linear(width, width), nn.Linear(width, 4))


def batch(rows: int = 24, width: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, width, generator=generator), \
        torch.randint(0, 4, (rows,), generator=generator)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What training would change: parameters, grads, buffers, optimizer state, RNG state."""
    local = [(n, p) for n, p in model.named_parameters() if not p.is_meta]
    return {
        "parameters": {n: p.detach().clone() for n, p in local},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in local},
        "buffers": {n: b.clone() for n, b in model.named_buffers() if not b.is_meta},
        "optimizer": {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v
                              for k, v in s.items()} for p, s in optimizer.state.items()},
        "rng": torch.get_rng_state(),
    }


def changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Names of what differs between two snapshots."""
    found = []
    for kind in ("parameters", "grads", "buffers"):
        for name, value in before[kind].items():
            other = after[kind][name]
            same = (value is None and other is None) or (
                value is not None and other is not None and torch.equal(value, other))
            if not same:
                found.append(f"{kind}:{name}")
    if before["optimizer"].keys() != after["optimizer"].keys() or any(
            not torch.equal(v, after["optimizer"][p][k]) for p, s in before["optimizer"].items()
            for k, v in s.items() if isinstance(v, torch.Tensor)):
        found.append("optimizer")
    if not torch.equal(before["rng"], after["rng"]):
        found.append("rng")
    return found


def predict_untouched(rank: int, world: int, schedule: str) -> dict[str, Any]:
    """Train one step (so grads and Adam state exist), predict, and report what changed."""
    from pipeline import Pipe

    model = bn_mlp()
    pipe = Pipe(model, chunks=4, schedule=schedule, loss_fn=nn.CrossEntropyLoss(),
                group=dist.group.WORLD)
    x, y = batch()
    placement = pipe.schedule.placement
    x = x if placement[0] == rank else None
    y = y if placement[-1] == rank else None
    optimizer = torch.optim.Adam(pipe.parameters())
    pipe.step(x, y)
    optimizer.step()
    pipe.step(x, y)  # grads present again, beside the optimizer's state
    before = snapshot(model, optimizer)
    timeline = pipe.predict(x, y, optimizer=optimizer)
    after = snapshot(model, optimizer)
    hops = pipe.ranks.hops(pipe.devices, pipe.schedule)  # what predict() calibrated
    pipe.close()
    return {
        "changed": changed(before, after),
        "events": [(e.stage, str(e.action), e.start, e.end) for e in timeline.events],
        "makespan": timeline.makespan,
        "peak_bytes": timeline.peak_bytes,
        "links": [(s, d, link.latency, link.bandwidth) for s, d, link in hops.links],
    }


def predict_missing_target(rank: int, world: int) -> str:
    """The last rank forgets its target: every rank must raise, none may hang."""
    from pipeline import Pipe

    pipe = Pipe(bn_mlp(), chunks=4, schedule="1f1b", loss_fn=nn.CrossEntropyLoss(),
                group=dist.group.WORLD, timeout=20.0)
    x, _ = batch()
    try:
        pipe.predict(x if rank == 0 else None, None)
    except ValueError as error:
        return str(error)
    finally:
        pipe.close()
    return "no error"


def predict_contention(rank: int, world: int) -> dict[str, Any]:
    """predict_step's contention factors, and the rank's own loop timed alone and at once."""
    from pipeline import Pipe
    from pipeline.compute.microbatch import split_batch
    from pipeline.predict.step import predict_step

    torch.set_num_threads(1)
    pipe = Pipe(bn_mlp(), chunks=4, schedule="1f1b", loss_fn=nn.CrossEntropyLoss(),
                group=dist.group.WORLD)
    x, y = batch()
    inputs, targets = split_batch(x if rank == 0 else None, y if rank == world - 1 else None,
                                  4, in_process=False)
    prediction = predict_step(pipe._runner, inputs, targets, ranks=pipe.ranks)
    pipe.close()
    return {"contention": prediction.contention, "makespan": prediction.timeline.makespan}


def calibrated_links(rank: int, world: int) -> dict[str, Any]:
    """The hop model ``calibrate_group`` gives every rank of a 1F1B pipeline."""
    from pipeline.group.links import calibrate_group
    from schedules import get_schedule

    hops = calibrate_group(dist.group.WORLD, get_schedule("1f1b", world, world),
                           torch.device("cpu"), 30.0)
    return {"links": [(s, d, k.latency, k.bandwidth) for s, d, k in hops.links],
            "senders": [(s, d, k.latency, k.bandwidth) for s, d, k in hops.senders]}
