"""Pipe.step leaves the gradients and loss of loss_fn(model(x), y).backward(), to 1e-10."""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import pytest
import torch
from torch import nn

from models import MODELS, batch, build, grads, loss_for, max_difference, reference
from pipeline import Pipe

TOLERANCE = 1e-10
ROWS = 13  # uneven for every chunk count below but 1
CHUNKS = (1, 3, 4)
MODES = ("always", "except_last", "never")


@cache
def case(name: str) -> tuple[nn.Sequential, Any, Any, torch.Tensor, list[torch.Tensor]]:
    """The model, batch and reference loss and gradients, computed once per model."""
    model = build(name)
    x, target = batch(name, ROWS)
    loss, expected = reference(model, x, target, loss_for(name))
    return model, x, target, loss, expected


def check_step(name: str, schedule: str, checkpoint: str, stages: int, chunks: int,
               loss_fn: nn.Module | None = None) -> None:
    model, x, target, expected_loss, expected = case(name)
    model = copy.deepcopy(model)
    loss_fn = loss_fn or loss_for(name)
    pipe = Pipe(model, chunks, stages=stages, schedule=schedule, checkpoint=checkpoint,
                loss_fn=loss_fn)
    loss = pipe.step(x, target)
    where = f"{name} {schedule} {checkpoint} stages={stages} chunks={chunks} balance={pipe.balance}"
    assert not loss.requires_grad, where
    assert abs(float(loss) - float(expected_loss)) < TOLERANCE, where
    difference = max_difference(grads(model), expected)
    assert difference < TOLERANCE, f"{where}: gradients differ by {difference:.3g}"


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("name", list(MODELS))
def test_gpipe_and_1f1b_match_the_whole_batch(name: str, schedule: str, checkpoint: str,
                                              stages: int) -> None:
    for chunks in CHUNKS:
        check_step(name, schedule, checkpoint, stages, chunks)


# Two chunks per stage: 4 stages make 8 chunks of the 9-layer models.
@pytest.mark.parametrize("stages", [1, 2, 4])
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-h1", "zb-h2", "zb-v"])
@pytest.mark.parametrize("name", list(MODELS))
def test_other_schedules_match_the_whole_batch(name: str, schedule: str, checkpoint: str,
                                               stages: int) -> None:
    for chunks in CHUNKS:
        check_step(name, schedule, checkpoint, stages, chunks)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_tuple_between_layers_and_tuple_input(schedule: str, checkpoint: str) -> None:
    # 6 layers: 3 stages (6 chunks with two per stage), a chunk boundary after each layer.
    for chunks in CHUNKS:
        check_step("tuple_model", schedule, checkpoint, 3, chunks)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h2", "zb-v"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_sum_reduction_adds_microbatch_losses(schedule: str, checkpoint: str) -> None:
    model = build("mlp")
    x, target = batch("mlp", ROWS)
    loss_fn = nn.MSELoss(reduction="sum")
    expected_loss, expected = reference(model, x, target, loss_fn)
    for chunks in CHUNKS:
        trained = copy.deepcopy(model)
        pipe = Pipe(trained, chunks, stages=2, schedule=schedule, checkpoint=checkpoint,
                    loss_fn=loss_fn)
        loss = pipe.step(x, target)
        assert abs(float(loss) - float(expected_loss)) < TOLERANCE * float(expected_loss)
        assert max_difference(grads(trained), expected) < TOLERANCE


def test_explicit_balance_and_schedule_object() -> None:
    from schedules import one_f_one_b

    model = build("residual_stack")
    x, target = batch("residual_stack", ROWS)
    _, expected = reference(model, x, target, nn.MSELoss())
    pipe = Pipe(model, 4, balance=[1, 5, 3], schedule=one_f_one_b(3, 4), loss_fn=nn.MSELoss())
    assert pipe.balance == [1, 5, 3]
    pipe.step(x, target)
    assert max_difference(grads(model), expected) < TOLERANCE


def test_gradients_accumulate_over_steps() -> None:
    model = build("mlp")
    x, target = batch("mlp", ROWS)
    _, expected = reference(model, x, target, nn.MSELoss())
    pipe = Pipe(model, 3, stages=3, schedule="zb-h1", loss_fn=nn.MSELoss())
    pipe.step(x, target)
    pipe.step(x, target)
    assert max_difference(grads(model), [2 * g for g in expected]) < TOLERANCE
    pipe.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    pipe.step(x, target)
    assert max_difference(grads(model), expected) < TOLERANCE


def test_presplit_microbatches_of_different_lengths() -> None:
    """A list of micro-batches (different sequence lengths) is weighted by rows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), MeanOverTime(), nn.Linear(8, 2)).double()
    generator = torch.Generator().manual_seed(3)
    lengths, rows = (5, 2, 7), (4, 3, 2)
    xs = [torch.randn(r, t, 4, generator=generator, dtype=torch.float64)
          for r, t in zip(rows, lengths)]
    ys = [torch.randn(r, 2, generator=generator, dtype=torch.float64) for r in rows]
    reference_model = copy.deepcopy(model)
    total = sum(rows)
    for x, y in zip(xs, ys):
        (nn.functional.mse_loss(reference_model(x), y) * x.shape[0] / total).backward()
    pipe = Pipe(model, 3, stages=2, loss_fn=nn.MSELoss())
    pipe.step(xs, ys)
    assert max_difference(grads(model), grads(reference_model)) < TOLERANCE


class MeanOverTime(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


class Hidden(nn.Module):
    """(features, labels) -> (hidden, labels): an integer tensor rides along the tuple."""

    def __init__(self, features: int = 8, out: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(features, out)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, labels = pair
        return torch.tanh(self.linear(x)), labels


class Embed(Hidden):
    """The first layer, holding a table it never uses (a parameter no gradient reaches)."""

    def __init__(self) -> None:
        super().__init__(features=6)
        self.table = nn.Embedding(3, 8)


class Gather(Hidden):
    """Uses the integer labels only at the end: picks one column per row."""

    def __init__(self) -> None:
        super().__init__(out=3)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, labels = pair
        return self.linear(h).gather(1, labels[:, None])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"])
def test_integer_tensor_in_the_tuple(schedule: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Embed(), Hidden(), Hidden(), Hidden(), Gather()).double()
    generator = torch.Generator().manual_seed(2)
    x = (torch.randn(ROWS, 6, generator=generator, dtype=torch.float64),
         torch.randint(0, 3, (ROWS,), generator=generator))
    target = torch.randn(ROWS, 1, generator=generator, dtype=torch.float64)
    _, expected = reference(model, x, target, nn.MSELoss())
    for chunks in CHUNKS:
        trained = copy.deepcopy(model)
        Pipe(trained, chunks, stages=2, schedule=schedule, loss_fn=nn.MSELoss()).step(x, target)
        assert max_difference(grads(trained), expected) < TOLERANCE


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zb-v", "interleaved-1f1b"])
def test_frozen_first_layers(schedule: str) -> None:
    model = build("mlp")
    for parameter in [*model[0].parameters(), *model[2].parameters()]:
        parameter.requires_grad_(False)
    x, target = batch("mlp", ROWS)
    _, expected = reference(model, x, target, nn.MSELoss())
    for checkpoint in ("always", "never"):
        trained = copy.deepcopy(model)
        Pipe(trained, 3, stages=4, schedule=schedule, checkpoint=checkpoint,
             loss_fn=nn.MSELoss()).step(x, target)
        assert all(p.grad is None for p in [*trained[0].parameters(), *trained[2].parameters()])
        assert max_difference(grads(trained), expected) < TOLERANCE


@pytest.mark.parametrize("balance", ["params", "time"])
def test_measured_balances(balance: str) -> None:
    model = build("residual_stack")
    x, target = batch("residual_stack", ROWS)
    _, expected = reference(model, x, target, nn.MSELoss())
    pipe = Pipe(model, 3, balance=balance, stages=3, loss_fn=nn.MSELoss())
    pipe.step(x, target)
    assert pipe.balance is not None and sum(pipe.balance) == len(model)
    assert len(pipe.balance) == 3 and min(pipe.balance) >= 1
    assert max_difference(grads(model), expected) < TOLERANCE
