"""The zoo sweeps, run in one process or inside spawned gloo ranks (importable by name).

Each sweep runs every registered schedule x checkpoint mode on P=2 stages and M=4
micro-batches and returns one row (a dict) per combination: its measurements, or
the one-line error it raised. A failing combination never stops the sweep, so one
run reports every failure. On ranks, each combination gets a fresh process group,
so messages a failed step left behind cannot reach the next one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import zoo

STAGES = 2
CHUNKS = 4  # uneven last micro-batch for both models (zoo.GPT_ROWS, zoo.CNN_ROWS)
MODES = ("always", "except_last", "never")
SEED = 1234  # torch.manual_seed before each step of the randomness sweep
Row = dict[str, Any]


@dataclass(frozen=True)
class Runtime:
    """Builds Pipes in one process (``distributed=False``: two CPU devices) or on ranks."""

    distributed: bool
    timeout: float = 20.0

    def pipe(self, model: nn.Sequential, schedule: str, checkpoint: str,
             loss_fn: nn.Module, **options: Any) -> Any:
        from pipeline import Pipe

        if not self.distributed:
            return Pipe(model, CHUNKS, devices=["cpu"] * STAGES, schedule=schedule,
                        checkpoint=checkpoint, loss_fn=loss_fn, timeout=self.timeout, **options)
        import torch.distributed as dist

        group = dist.new_group(list(range(STAGES)))
        return Pipe(model, CHUNKS, schedule=schedule, checkpoint=checkpoint, loss_fn=loss_fn,
                    group=group, timeout=self.timeout, **options)

    def holds_first_chunk(self, pipe: Any) -> bool:
        if not self.distributed:
            return True
        import torch.distributed as dist

        return bool(pipe.schedule.placement[0] == dist.get_rank())


def combinations() -> list[tuple[str, str]]:
    """Every registered schedule x checkpoint mode."""
    from schedules import schedule_names

    return [(schedule, mode) for schedule in schedule_names() for mode in MODES]


def _sweep(run_one: Callable[[str, str], Row]) -> list[Row]:
    rows = []
    for schedule, mode in combinations():
        row: Row = {"schedule": schedule, "mode": mode, "error": None}
        try:
            row.update(run_one(schedule, mode))
        except Exception as error:  # noqa: BLE001 - reported per combination
            row["error"] = zoo.failure_text(error)
        rows.append(row)
    return rows


def gpt_exact(runtime: Runtime) -> list[Row]:
    """GPT without randomness: loss and gradients against the whole unpipelined batch."""
    model = zoo.tiny_gpt()
    x, y = zoo.gpt_batch()
    expected_loss, expected = zoo.reference_grads(model, x, y, zoo.gpt_loss())

    def run_one(schedule: str, mode: str) -> Row:
        trained = copy.deepcopy(model)
        pipe = runtime.pipe(trained, schedule, mode, zoo.gpt_loss())
        loss = float(pipe.step(x, y))
        grad_error, compared = zoo.grad_errors(trained, expected)
        return {"loss": loss, "loss_error": abs(loss - expected_loss),
                "grad_error": grad_error, "compared": compared}

    return _sweep(run_one)


def gpt_random(runtime: Runtime) -> list[Row]:
    """GPT with dropout and stochastic depth: loss and held gradients after one seeded step."""
    model = zoo.tiny_gpt(drop_path=0.1, dropout=0.1)
    x, y = zoo.gpt_batch()

    def run_one(schedule: str, mode: str) -> Row:
        trained = copy.deepcopy(model)
        pipe = runtime.pipe(trained, schedule, mode, zoo.gpt_loss())
        torch.manual_seed(SEED)
        loss = float(pipe.step(x, y))
        # Plain lists: tensors would cross from a rank as shared memory the rank takes with it.
        grads = {key: p.grad.tolist() for key, p in zoo.per_layer_parameters(trained).items()
                 if not p.is_meta and p.grad is not None}
        return {"loss": loss, "grads": grads}

    return _sweep(run_one)


def resnet_statistics(runtime: Runtime, deferred: bool) -> list[Row]:
    """ResNet cut before an in-place ReLU: loss, gradients and BatchNorm buffers.

    Gradients are compared with the unpipelined model run micro-batch by micro-batch
    (BatchNorm normalises by micro-batch statistics), the running statistics with one
    update per step (``deferred``) or one per micro-batch.
    """
    from schedules import get_schedule

    model = zoo.resnet()
    x, y = zoo.image_batch()
    reference = zoo.microbatch_reference(model, x, y, zoo.resnet_loss(), CHUNKS)
    expected_loss, expected = reference.loss, reference.grads
    statistics = reference.deferred_statistics if deferred else reference.statistics

    def run_one(schedule: str, mode: str) -> Row:
        trained = copy.deepcopy(model)
        balance = zoo.resnet_balance(get_schedule(schedule, STAGES, CHUNKS).chunks)
        options: dict[str, Any] = {"deferred_batch_norm": True} if deferred else {}
        pipe = runtime.pipe(trained, schedule, mode, zoo.resnet_loss(), balance=balance,
                            **options)
        loss = float(pipe.step(x, y))
        grad_error, compared = zoo.grad_errors(trained, expected)
        return {"loss_error": abs(loss - expected_loss), "grad_error": grad_error,
                "buffer_error": zoo.buffer_error(trained, statistics), "compared": compared}

    return _sweep(run_one)


def input_grad(runtime: Runtime) -> list[Row]:
    """ResNet (uniform cut) on an input that requires grad: ``x.grad`` where x was read."""
    model = zoo.resnet()
    images, y = zoo.image_batch()
    expected = zoo.microbatch_reference(model, images, y, zoo.resnet_loss(), CHUNKS).input_grad

    def run_one(schedule: str, mode: str) -> Row:
        trained = copy.deepcopy(model)
        pipe = runtime.pipe(trained, schedule, mode, zoo.resnet_loss())
        x = images.clone().requires_grad_(True)
        pipe.step(x, y)
        if not runtime.holds_first_chunk(pipe):
            return {"input_error": None}
        if x.grad is None:
            return {"input_error": float("inf")}
        return {"input_error": zoo.difference(x.grad, expected)}

    return _sweep(run_one)


SWEEPS: dict[str, Callable[[Runtime], list[Row]]] = {
    "gpt_exact": gpt_exact,
    "gpt_random": gpt_random,
    "resnet_deferred": lambda runtime: resnet_statistics(runtime, deferred=True),
    "resnet_per_microbatch": lambda runtime: resnet_statistics(runtime, deferred=False),
    "input_grad": input_grad,
}


def run_sweeps(distributed: bool) -> dict[str, list[Row]]:
    """Every sweep in this process (one process, or this rank of a group)."""
    runtime = Runtime(distributed)
    return {name: sweep(runtime) for name, sweep in SWEEPS.items()}


def on_rank(rank: int, world: int) -> dict[str, list[Row]]:
    """The entry point of each spawned gloo rank."""
    torch.set_num_threads(1)
    return run_sweeps(distributed=True)
