"""Recomputation is exact: dropout masks repeat, checkpoint modes agree bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from models import batch, build, grads, max_difference, reference
from pipeline import Pipe

MODES = ("always", "except_last", "never")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")


def dropout_step(schedule: str, checkpoint: str, seed: int = 7, chunks: int = 4,
                 stages: int = 2) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Loss, gradients and the caller's next random number after one step under ``seed``."""
    model = build("dropout_mlp")
    x, target = batch("dropout_mlp")
    pipe = Pipe(model, chunks, stages=stages, schedule=schedule, checkpoint=checkpoint,
                loss_fn=nn.MSELoss())
    torch.manual_seed(seed)
    loss = pipe.step(x, target)
    return loss, grads(model), torch.rand(1)


def bitwise_equal(left: list[torch.Tensor], right: list[torch.Tensor]) -> bool:
    return len(left) == len(right) and all(torch.equal(a, b) for a, b in zip(left, right))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_same_seed_twice_gives_bit_identical_gradients(schedule: str) -> None:
    first = dropout_step(schedule, "except_last")
    second = dropout_step(schedule, "except_last")
    assert torch.equal(first[0], second[0])
    assert bitwise_equal(first[1], second[1])
    other_seed = dropout_step(schedule, "except_last", seed=8)
    assert not bitwise_equal(first[1], other_seed[1]), "dropout should depend on the seed"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_checkpoint_modes_give_bit_identical_gradients_with_dropout(schedule: str) -> None:
    results = {mode: dropout_step(schedule, mode) for mode in MODES}
    for mode in ("always", "except_last"):
        assert torch.equal(results[mode][0], results["never"][0]), mode
        assert bitwise_equal(results[mode][1], results["never"][1]), (
            f"{schedule}: {mode} differs from never by "
            f"{max_difference(results[mode][1], results['never'][1]):.3g}"
        )
        # The step takes the same number of draws from the caller's generator.
        assert torch.equal(results[mode][2], results["never"][2]), mode


def test_dropout_is_active_and_schedules_agree() -> None:
    """Masks are per (chunk, micro-batch), so the order of the schedule does not change them."""
    model = build("dropout_mlp")
    x, target = batch("dropout_mlp")
    _, without_pipeline = reference(model, x, target, nn.MSELoss())
    reference_grads = dropout_step("1f1b", "never")[1]
    assert max_difference(reference_grads, without_pipeline) > 1e-3, "dropout did nothing"
    for schedule in ("gpipe", "zb-h1", "zb-h2"):
        # Same chunks, same micro-batches: only the order of accumulation may differ.
        assert max_difference(dropout_step(schedule, "always")[1], reference_grads) < 1e-12


def test_eval_mode_dropout_matches_the_unpipelined_model() -> None:
    model = build("dropout_mlp").eval()
    x, target = batch("dropout_mlp")
    _, expected = reference(model, x, target, nn.MSELoss())
    pipe = Pipe(model, 3, stages=3, checkpoint="always", loss_fn=nn.MSELoss())
    pipe.step(x, target)
    assert max_difference(grads(model), expected) < 1e-10


class CountingTanh(nn.Tanh):
    """Tanh that counts how often its forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zb-v"])
@pytest.mark.parametrize(("checkpoint", "extra"), [("always", 4), ("except_last", 3), ("never", 0)])
def test_recomputation_reruns_each_forward_once(schedule: str, checkpoint: str, extra: int) -> None:
    torch.manual_seed(0)
    counters = [CountingTanh() for _ in range(4)]
    layers: list[nn.Module] = []
    for counter in counters:
        layers += [nn.Linear(6 if not layers else 5, 5), counter]
    model = nn.Sequential(*layers).double()
    x = torch.randn(8, 6, dtype=torch.float64)
    target = torch.randn(8, 5, dtype=torch.float64)
    _, expected = reference(model, x, target, nn.MSELoss())
    pipe = Pipe(model, 4, stages=2, schedule=schedule, checkpoint=checkpoint, loss_fn=nn.MSELoss())
    pipe.step(x, target)
    assert [c.calls for c in counters] == [4 + extra] * 4
    assert max_difference(grads(model), expected) < 1e-10


def test_always_recomputes_every_microbatch_and_pipe_stays_reusable() -> None:
    model = build("residual_stack")
    x, target = batch("residual_stack")
    _, expected = reference(model, x, target, nn.MSELoss())
    pipe = Pipe(copy.deepcopy(model), 4, stages=4, checkpoint="always", loss_fn=nn.MSELoss())
    for _ in range(3):
        pipe.zero_grad()
        pipe.step(x, target)
        assert max_difference(grads(pipe.model), expected) < 1e-10


def _spectral_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)]
    for index in (0, 2, 4):
        nn.utils.parametrizations.spectral_norm(layers[index])
    return nn.Sequential(*layers).double()


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-v"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_state_a_forward_writes_is_not_written_again_by_its_recomputation(
        schedule: str, checkpoint: str) -> None:
    """Spectral norm refines its vectors in every training forward: a recomputation runs
    with the vectors its forward saw, and leaves them as the forwards left them."""
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.randn(8, 3, dtype=torch.float64)
    balance = [3, 2] if schedule != "zb-v" else [2, 1, 1, 1]
    results = []
    for mode in ("never", checkpoint):
        model = _spectral_model()
        pipe = Pipe(model, 4, balance=balance, devices=["cpu", "cpu"], schedule=schedule,
                    checkpoint=mode, loss_fn=nn.MSELoss())
        for _ in range(2):
            pipe.step(x, y)
        results.append((grads(model), [b.clone() for b in model.buffers()]))
    (plain_grads, plain_buffers), (recomputed_grads, recomputed_buffers) = results
    assert max_difference(plain_grads, recomputed_grads) < 1e-10
    assert all(torch.equal(a, b) for a, b in zip(plain_buffers, recomputed_buffers))
