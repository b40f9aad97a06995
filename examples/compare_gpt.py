"""``train_gpt.py --compare``: the pipelined GPT against the unpipelined one, step by step.

Rank 0 keeps the plain model and its own optimizer and steps them on each step's whole
batch; every rank sends its loss, parameters and gradients (sharded ones gathered whole,
as plain values: nothing is pickled), and rank 0 requires each to agree to 1e-10.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from gpt import lm_loss  # examples/gpt.py, beside this script
from pipeline import Pipe
from pipeline.group.collectives import broadcast_object, gather_objects

TOLERANCE = 1e-10
CLIP = 1.0  # the gradients' largest total norm, in both models


@dataclass(frozen=True)
class Reference:
    """Rank 0's unpipelined model and its optimizer, stepped on each step's whole batch."""

    model: nn.Sequential
    optimizer: torch.optim.Optimizer


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor gathered whole (a collective over its mesh); others as they are."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def parameters_and_grads(model: nn.Sequential, layers: Iterable[int]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``"{layer}.{name}"`` -> parameter, and -> gradient, of ``layers`` (CPU copies).

    A tied parameter appears under each layer holding it. Sharded tensors are gathered
    whole, so the ranks holding one stage must call this alike (same layers, same order).
    """
    parameters, grads = {}, {}
    for index in layers:
        for name, parameter in model[index].named_parameters():
            key = f"{index}.{name}"
            parameters[key] = whole(parameter.detach()).cpu()
            if parameter.grad is not None:
                grads[key] = whole(parameter.grad).cpu()
    return parameters, grads


def compare_step(pipe: Pipe, device: torch.device, reference: Reference | None,
                 loss: float | None, batch: tuple[torch.Tensor, torch.Tensor] | None
                 ) -> str | None:
    """This step against the unpipelined model's (checked on rank 0): a problem or None, on
    every rank. Every rank takes part. With ``batch`` None (after the last step) only the
    parameters are compared."""
    parameters, grads = parameters_and_grads(pipe.model, pipe.local_layers)
    world, what = dist.group.WORLD, "comparing with the unpipelined model"
    assert world is not None
    pieces = gather_objects({"loss": loss, "parameters": parameters, "grads": grads}, world,
                            pipe.timeout, what, device)  # never pickled
    verdict = None if reference is None else _check_against(reference, pieces, batch)
    shared: str | None = broadcast_object(verdict, 0, world, pipe.timeout, what, device)
    return shared


def _check_against(reference: Reference, pieces: list[dict[str, Any]],
                   batch: tuple[torch.Tensor, torch.Tensor] | None) -> str | None:
    model, every_layer = reference.model, range(len(reference.model))
    expected, _ = parameters_and_grads(model, every_layer)
    problem = _first_difference("parameter", [piece["parameters"] for piece in pieces], expected)
    if problem is not None or batch is None:
        return problem
    # The parameters agree to the tolerance: go on from the pipe's own values, so that
    # differences far below it cannot add up over a long run.
    model.load_state_dict({key: value for piece in pieces
                           for key, value in piece["parameters"].items()})
    reference.optimizer.zero_grad(set_to_none=True)
    expected_loss = lm_loss()(model(batch[0]), batch[1])
    expected_loss.backward()
    for rank, piece in enumerate(pieces):
        if not abs(expected_loss.item() - piece["loss"]) < TOLERANCE:
            return f"rank {rank}: loss {piece['loss']!r}, unpipelined {expected_loss.item()!r}"
    _, expected_grads = parameters_and_grads(model, every_layer)
    problem = _first_difference("gradient", [piece["grads"] for piece in pieces], expected_grads)
    nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    reference.optimizer.step()
    return problem


def _first_difference(what: str, held: list[dict[str, torch.Tensor]],
                      expected: dict[str, torch.Tensor]) -> str | None:
    seen = set()
    for rank, tensors in enumerate(held):
        for key, tensor in tensors.items():
            seen.add(key)
            difference = float((tensor - expected[key]).abs().max())
            if not difference < TOLERANCE:
                return f"rank {rank}: {what} {key} differs by {difference:.3g}"
    missing = sorted(set(expected) - seen)
    return f"no rank has a {what} for {missing}" if missing else None


def stop_on(problem: str | None, when: str) -> None:
    """Every rank stops on a problem; rank 0 says why."""
    if problem is not None:
        raise SystemExit(f"{when}: pipelined != unpipelined: {problem}"
                         if dist.get_rank() == 0 else 1)
