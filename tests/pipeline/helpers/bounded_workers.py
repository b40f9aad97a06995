"""Rank functions for tests/pipeline/group/test_bounded.py (importable by name)."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from dist_harness import outcome

TIMEOUT = 2.0  # every Pipe's here
BOUND = 6.0  # seconds a waiting rank's call may take: the timeout and room for a loaded machine
# Rank 0's four calls take about 4.2 timeouts; rank 1 stays silent past them, and past BOUND
# from the second call's start, so that a call hanging until rank 1 wakes still fails the
# test's bound.
SILENCE = 11.0  # seconds rank 1 stays silent
STALL = BOUND + 2.0  # seconds a stalled replica sleeps: past the bound
HELD = 60.0  # seconds replica_fails' ranks wait for each other after their steps, at most


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh()).double()


def silent_during_every_call(rank: int, world: int) -> list[tuple[str, str, float]]:
    """Rank 1 builds four Pipes, then goes silent; rank 0 calls gather_state_dict, step,
    predict and close on them in turn. Rank 0's (call, outcome, seconds) per call."""
    from pipeline import Pipe, gather_state_dict, save_state_dict

    torch.set_num_threads(1)
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.randn(8, 6, dtype=torch.float64)
    pipes = [Pipe(_mlp(), 2, schedule="1f1b", loss_fn=nn.MSELoss(), timeout=TIMEOUT,
                  group=dist.new_group(list(range(world)))) for _ in range(4)]
    if rank == 1:
        time.sleep(SILENCE)
        return []
    calls = {
        "gather_state_dict": lambda: gather_state_dict(pipes[0]),
        "step": lambda: pipes[1].step(x, None),
        "predict": lambda: pipes[2].predict(x, None),
        "close": lambda: pipes[3].close(),
    }
    outcomes = [(name, *outcome(call, limit=200)) for name, call in calls.items()]
    started = time.monotonic()
    save_state_dict({"weight": torch.zeros(3)}, f"/tmp/pipesched-bounded-{rank}.pt")
    outcomes.append(("save_state_dict", "returned", time.monotonic() - started))
    return outcomes


def dropped_pipes(rank: int, world: int, count: int) -> tuple[int, int]:
    """Build and drop ``count`` Pipes without close(), a step each: open descriptors before
    and after."""
    import gc
    import os

    from pipeline import Pipe

    torch.set_num_threads(1)
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.randn(8, 6, dtype=torch.float64)

    def descriptors() -> int:
        gc.collect()
        return len(os.listdir("/proc/self/fd"))

    Pipe(_mlp(), 2, schedule="1f1b", loss_fn=nn.MSELoss(), group=dist.group.WORLD).step(
        x if rank == 0 else None, y if rank == world - 1 else None)
    before = descriptors()
    for _ in range(count):
        pipe = Pipe(_mlp(), 2, schedule="1f1b", loss_fn=nn.MSELoss(), group=dist.group.WORLD)
        pipe.step(x if rank == 0 else None, y if rank == world - 1 else None)
        del pipe
    dist.barrier()
    return before, descriptors()


def lone_validation(rank: int, world: int, transport: str) -> list[tuple[str, str, float]]:
    """Rank 0 runs pipe(x_val) alone, then both ranks step. Per call: (call, outcome, seconds);
    last, whether every gradient is still None."""
    from pipeline import Distributed, Pipe

    torch.set_num_threads(1)
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.randn(8, 6, dtype=torch.float64)
    group = dist.new_group(list(range(world)))  # left broken: later calls use fresh groups
    pipe = Pipe(_mlp(), 2, schedule="1f1b", loss_fn=nn.MSELoss(), timeout=TIMEOUT,
                distributed=Distributed(group, transport=transport))
    calls = {"step": lambda: pipe.step(x if rank == 0 else None, y if rank == world - 1 else None)}
    if rank == 0:
        calls = {"pipe(x)": lambda: pipe(x), **calls}
    outcomes = [(name, *outcome(call)) for name, call in calls.items()]
    untouched = all(p.grad is None for p in pipe.parameters())
    dist.barrier(dist.new_group(list(range(world))))  # neither leaves while the other waits
    return [*outcomes, ("gradients untouched", str(untouched), 0.0)]


class FailsOn(nn.Module):
    """Raises, or stalls for ``STALL`` seconds, in its forward on global rank ``rank``."""

    def __init__(self, rank: int, how: str) -> None:
        super().__init__()
        self.rank, self.how = rank, how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == self.rank:
            if self.how == "raise":
                raise RuntimeError("this replica's stage fails")
            time.sleep(STALL)
        return x


def replica_fails(rank: int, world: int, data_parallel: str, stage: int, failing: int,
                  how: str) -> tuple[str, float, bool]:
    """A (pp, dp) = (2, 2) mesh, ``Pipe(timeout=TIMEOUT)``: a layer of ``stage`` raises (``how``
    "raise") or stalls (``"stall"``) on global rank ``failing`` in the first forward. This
    rank's step: (outcome, seconds, whether every gradient is still None)."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeline import Distributed, Pipe

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    held = dist.new_group(list(range(world)), timeout=timedelta(seconds=HELD))
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh()]
    layers.insert(1 if stage == 0 else 3, FailsOn(failing, how))
    model = nn.Sequential(*layers).double()
    pipe = Pipe(model, 2, balance=[2, 3], schedule="1f1b", loss_fn=nn.MSELoss(), timeout=TIMEOUT,
                distributed=Distributed.from_mesh(mesh, data_parallel=data_parallel))
    x = torch.randn(4, 6, dtype=torch.float64)
    said, seconds = outcome(lambda: pipe.step(x, x), limit=300)
    # No rank leaves, nor drops its Pipe, before every rank's step has ended: a rank waiting
    # for a failed one until it leaves would otherwise be freed early, by a raw gloo error.
    # (Were it to wait so, the failed rank would wait here for HELD seconds and raise.)
    dist.barrier(group=held)
    return said, seconds, all(p.grad is None for p in pipe.parameters())
