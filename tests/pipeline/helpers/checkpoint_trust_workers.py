"""Rank functions for the checkpoint trust tests: saving changes nothing, loading is strict and
checked, nothing a peer or a file sends runs code, and every wait is bounded."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checkpoint_workers import CHUNKS, named_parameters, portable
from dist_workers import batch, deep_mlp
from hostile import Evil

FRESH_OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = {
    "adam": lambda parameters: torch.optim.Adam(parameters, lr=0.01),
    "rprop": lambda parameters: torch.optim.Rprop(parameters, lr=0.01),
}
SAVES = ("never", "before the first step", "with gradients, before optimizer.step")
STEPS = 3
TIMEOUT = 2.0  # the Pipe's in bounded_waits
BOUND = 6.0  # seconds a waiting rank's call may take: the timeout and room for a loaded machine
STALL = BOUND + 2.0  # seconds a stalled peer sleeps inside a call: past the bound
# A silent peer is silent through two calls: past the first's timeout and BOUND beyond it,
# so that the second, had it waited for the peer to wake, would still fail the bound.
SILENCE = TIMEOUT + BOUND + 2.0



def tied_mlp(tied: bool = True) -> nn.Sequential:
    """``deep_mlp`` whose last Linear is the first one's weight (a head tied to the input)."""
    model = deep_mlp()
    if tied:
        model[14].weight = model[0].weight
    return model


def _ends(pipe: Any, rank: int) -> tuple[bool, bool]:
    alone = pipe.ranks.size == 1
    return (alone or pipe.schedule.placement[0] == rank,
            alone or pipe.schedule.placement[-1] == rank)


def train_saving(pipe: Any, optimizer: torch.optim.Optimizer, directory: Path | None,
                 save: str, rank: int = 0) -> None:
    """``STEPS`` steps of a fresh optimizer, saving to ``directory`` where ``save`` says."""
    from pipeline import save_checkpoint

    first, last = _ends(pipe, rank)
    for step in range(STEPS):
        x, y = batch(seed=step)
        optimizer.zero_grad()
        if step == 0 and save == SAVES[1]:
            save_checkpoint(pipe, optimizer, directory, 0)
        pipe.step(x if first else None, y if last else None)
        if step == 0 and save == SAVES[2]:
            save_checkpoint(pipe, optimizer, directory, 0)
        optimizer.step()


def fresh_saves(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Per optimizer and kind of save: the parameters after ``STEPS`` steps; and those of a
    fresh pipeline resumed from the save before the first step."""
    from pipeline import Pipe, load_checkpoint

    torch.set_num_threads(1)
    found: dict[str, Any] = {}
    for name, make in FRESH_OPTIMIZERS.items():
        for save in SAVES:
            pipe = Pipe(deep_mlp(), chunks=CHUNKS, loss_fn=nn.MSELoss(), group=dist.group.WORLD)
            optimizer = make(pipe.parameters())
            train_saving(pipe, optimizer, Path(directory) / f"{name}-{SAVES.index(save)}", save,
                         rank)
            found[f"{name}/{save}"] = named_parameters(pipe.model)
            pipe.close()
        pipe = Pipe(deep_mlp(blocks=8), chunks=CHUNKS, loss_fn=nn.MSELoss(),
                    group=dist.group.WORLD)
        optimizer = make(pipe.parameters())
        load_checkpoint(pipe, optimizer, Path(directory) / f"{name}-1")
        train_saving(pipe, optimizer, None, SAVES[0], rank)
        found[f"{name}/resumed"] = named_parameters(pipe.model)
        pipe.close()
    return dict(portable(found))


def _caught(call: Callable[[], Any]) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        call()
        return "", "", time.monotonic() - start
    except Exception as error:  # noqa: BLE001 - reported to the test
        return type(error).__name__, str(error), time.monotonic() - start


def untied_into_tied(rank: int, world: int, untied: str) -> dict[str, Any]:
    """Load the untied checkpoint at ``untied`` into a tied pipeline; what each rank raised,
    and whether its parameters stayed as they were."""
    from pipeline import Pipe, load_checkpoint

    torch.set_num_threads(1)
    pipe = Pipe(tied_mlp(), chunks=CHUNKS, loss_fn=nn.MSELoss(), group=dist.group.WORLD)
    before = named_parameters(pipe.model)
    kind, message, _ = _caught(lambda: load_checkpoint(pipe, None, untied))
    after = named_parameters(pipe.model)
    unchanged = all(torch.equal(after[key], before[key]) for key in before)
    pipe.close()
    return {"kind": kind, "message": message, "unchanged": unchanged,
            "layers": sorted({int(key.split(".")[0]) for key in before})}


def corrupt_files(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Save on every rank, flip one byte of rank 1's shard (then empty ``.metadata`` of
    another save), and load: what each rank raised."""
    from pipeline import Pipe, load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    found = {}
    for case in ("flipped", "empty"):
        target = Path(directory) / case
        pipe = Pipe(deep_mlp(), chunks=CHUNKS, loss_fn=nn.MSELoss(), group=dist.group.WORLD)
        optimizer = torch.optim.Adam(pipe.parameters())
        save_checkpoint(pipe, optimizer, target, 1)
        if rank == 0:
            if case == "flipped":
                shard = target / "__1_0.distcp"
                data = bytearray(shard.read_bytes())
                data[len(data) // 2] ^= 0x01
                shard.write_bytes(bytes(data))
            else:
                (target / ".metadata").write_bytes(b"")
        dist.barrier()
        found[case] = _caught(lambda: load_checkpoint(pipe, optimizer, target))[:2]
        pipe.close()
    return found


def hostile_peer(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Rank 1 sends a plan holding an object whose unpickling creates a file, then write
    results naming a file outside the checkpoint: what each rank raised, and the file."""
    import pipeline.saving.checkpoints as checkpoints
    from pipeline import Pipe, save_checkpoint

    torch.set_num_threads(1)
    proof = Path(directory) / "created-by-a-peer"
    honest_plan, honest_results = checkpoints.plan_plain, checkpoints.results_plain
    found: dict[str, Any] = {}
    pipe = Pipe(deep_mlp(), chunks=CHUNKS, loss_fn=nn.MSELoss(), group=dist.group.WORLD)
    optimizer = torch.optim.Adam(pipe.parameters())
    if rank == 1:
        checkpoints.plan_plain = lambda plan: {**honest_plan(plan), "extra": Evil(str(proof))}
    found["object"] = _caught(lambda: save_checkpoint(pipe, optimizer,
                                                      Path(directory) / "object", 1))[:2]
    checkpoints.plan_plain = honest_plan
    if rank == 1:
        def outside(results: Any) -> Any:
            plain = honest_results(results)
            plain[0]["storage"]["file"] = "../../outside.distcp"
            return plain

        checkpoints.results_plain = outside
    found["path"] = _caught(lambda: save_checkpoint(pipe, optimizer,
                                                    Path(directory) / "path", 1))[:2]
    checkpoints.results_plain = honest_results
    dist.barrier()
    found["created"] = proof.exists()
    found["published"] = sorted(p.name for p in Path(directory).iterdir())
    pipe.close()
    return found


def _stalled(function: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    def stalled(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return function(*args, **kwargs)

    return stalled


# The cases of bounded_waits, a launch each (their waits overlap): both silent-peer cases
# happen during one silence.
BOUNDED_LAUNCHES = (("save, silent peer", "load, silent peer"), ("save, stalled peer",),
                    ("load, stalled peer",))


def bounded_waits(rank: int, world: int, directory: str, cases: tuple[str, ...]
                  ) -> dict[str, Any]:
    """With ``Pipe(timeout=TIMEOUT)``, each of ``cases`` (of ``BOUNDED_LAUNCHES``): a save and a
    load while rank 1 is silent (both during one silence), or one while it stalls inside.
    Each case on a fresh group (a timed-out collective leaves its group unusable). Per case,
    what each rank raised and after how many seconds."""
    import pipeline.saving.checkpoints as checkpoints
    from pipeline import Pipe, load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    target = Path(directory) / "run"
    found: dict[str, Any] = {}

    def fresh() -> tuple[Any, torch.optim.Optimizer]:
        group = dist.new_group([0, 1])
        pipe = Pipe(deep_mlp(), chunks=CHUNKS, loss_fn=nn.MSELoss(), group=group,
                    timeout=TIMEOUT)
        return pipe, torch.optim.Adam(pipe.parameters())

    def call(case: str, pipe: Any, optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
        if case.startswith("save"):
            return lambda: save_checkpoint(pipe, optimizer, target, 2)
        return lambda: load_checkpoint(pipe, optimizer, target)

    # What the loads below read; under the default timeout, since this save is no case
    # (launched beside other ranks, it may take more than TIMEOUT).
    pipe = Pipe(deep_mlp(), chunks=CHUNKS, loss_fn=nn.MSELoss(), group=dist.new_group([0, 1]))
    save_checkpoint(pipe, torch.optim.Adam(pipe.parameters()), target, 1)
    silent = {case: fresh() for case in cases if case.endswith("silent peer")}
    if silent and rank == 1:  # both Pipes built (building is collective), then silent
        time.sleep(SILENCE)  # through both calls
    for case, (pipe, optimizer) in silent.items():
        found[case] = ("", "silent", 0.0) if rank == 1 else _caught(call(case, pipe, optimizer))
    for case in (case for case in cases if case.endswith("stalled peer")):
        pipe, optimizer = fresh()
        if rank == 1:
            name = "save_state" if case.startswith("save") else "plan_reading"
            honest = getattr(checkpoints, name)
            setattr(checkpoints, name, _stalled(honest, STALL))
            found[case] = _caught(call(case, pipe, optimizer))
            setattr(checkpoints, name, honest)
        else:
            found[case] = _caught(call(case, pipe, optimizer))
    return found
