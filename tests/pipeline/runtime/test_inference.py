"""pipe(x) is model(x): forwards only, differentiable when grad is on, the model left as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import inference_workers
from dist_harness import run_ranks
from models import MODELS, batch, build, grads, loss_for, max_difference, reference
from pipeline import Pipe

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", list(MODELS))
def test_output_equals_the_model(name: str, schedule: str) -> None:
    model = build(name)
    x, _ = batch(name)
    expected = model(x).detach()
    for chunks in (1, 3, 4):
        pipe = Pipe(model, chunks, stages=4, schedule=schedule)
        with torch.no_grad():
            out = pipe(x)
        assert out.shape == expected.shape
        assert not out.requires_grad
        # Micro-batches may round differently from the whole batch in the last bits only.
        torch.testing.assert_close(out, expected, rtol=1e-13, atol=1e-13)
        if chunks == 1:
            assert torch.equal(out, expected)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", ["mlp", "small_cnn", "tuple_model"])
def test_backward_through_the_output_gives_the_reference_gradients(
    name: str, schedule: str
) -> None:
    model = build(name)
    x, target = batch(name)
    loss_fn = loss_for(name)
    expected_loss, expected = reference(model, x, target, loss_fn)
    stages = 3
    pipe = Pipe(model, 4, stages=stages, schedule=schedule)
    out = pipe(x)
    assert out.requires_grad
    loss = loss_fn(out, target)
    loss.backward()
    assert abs(loss.detach().item() - expected_loss.item()) < 1e-12
    assert max_difference(grads(model), expected) < 1e-10


def test_tuple_output_is_merged_per_tensor() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), Fork()).double()
    x, _ = batch("mlp", 9)
    out = Pipe(model, 3, stages=2)(x)
    expected = model(x)
    assert isinstance(out, tuple) and len(out) == 2
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


def test_tuple_input() -> None:
    model = build("tuple_model")
    x, _ = batch("tuple_model")
    out = Pipe(model, 4, stages=3)(x)
    torch.testing.assert_close(out, model(x), rtol=1e-13, atol=1e-13)


def test_presplit_input_returns_one_output_per_microbatch() -> None:
    model = build("mlp")
    x, _ = batch("mlp", 9)
    parts = [x[:2], x[2:7], x[7:]]
    out = Pipe(model, 3, stages=3)(parts)
    assert isinstance(out, list) and len(out) == 3
    for got, part in zip(out, parts):
        torch.testing.assert_close(got, model(part), rtol=1e-13, atol=1e-13)


def test_eval_mode_with_dropout_is_deterministic_and_equals_the_model() -> None:
    model = build("dropout_mlp")
    x, _ = batch("dropout_mlp")
    pipe = Pipe(model, 4, stages=2).eval()
    assert not model.training
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x), rtol=1e-13, atol=1e-13)
    pipe.train()
    assert model.training
    with torch.no_grad():
        torch.manual_seed(5)
        first = pipe(x)
        torch.manual_seed(5)
        second = pipe(x)
    assert torch.equal(first, second)
    assert not torch.allclose(first, model.eval()(x))  # dropout was on


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-v"])
def test_wrapping_keeps_the_state_dict(schedule: str) -> None:
    model = build("residual_stack")
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    keys = list(model.state_dict())
    pipe = Pipe(model, 4, stages=4, schedule=schedule, loss_fn=nn.MSELoss())
    assert list(model.state_dict()) == keys
    assert list(pipe.state_dict()) == keys
    for key, value in model.state_dict().items():
        assert value.data_ptr() == before[key][0], f"{key} was copied (on one device)"
        assert torch.equal(value, before[key][1])
    x, target = batch("residual_stack")
    pipe.step(x, target)
    assert list(model.state_dict()) == keys
    # Loading the state back through the Pipe round-trips.
    state = copy.deepcopy(pipe.state_dict())
    pipe.load_state_dict(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_parameters_and_zero_grad_are_the_models() -> None:
    model = build("mlp")
    pipe = Pipe(model, 2, stages=3, loss_fn=nn.MSELoss())
    assert [id(p) for p in pipe.parameters()] == [id(p) for p in model.parameters()]
    x, target = batch("mlp")
    pipe.step(x, target)
    assert all(p.grad is not None for p in model.parameters())
    pipe.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_clip_grad_norm_matches_torch() -> None:
    model = build("mlp")
    x, target = batch("mlp")
    reference_model = copy.deepcopy(model)
    nn.MSELoss()(reference_model(x), target).backward()
    expected = nn.utils.clip_grad_norm_(reference_model.parameters(), 0.01)
    pipe = Pipe(model, 3, stages=3, loss_fn=nn.MSELoss())
    pipe.step(x, target)
    norm = pipe.clip_grad_norm_(0.01)
    assert abs(float(norm) - float(expected)) < 1e-12
    assert max_difference(grads(model), grads(reference_model)) < 1e-12


def test_properties() -> None:
    model = build("mlp")
    pipe = Pipe(model, 5, balance=[1, 2, 3, 3], schedule="gpipe")
    assert pipe.balance == [1, 2, 3, 3]
    assert pipe.stages == 4 and pipe.schedule.stages == 4 and pipe.schedule.microbatches == 5
    assert pipe.schedule.name == "gpipe"
    assert pipe.devices == [torch.device("cpu")] * 4
    assert pipe.timeline is None  # until a step ran
    interleaved = Pipe(build("mlp"), 4, stages=2, schedule="interleaved-1f1b")
    assert len(interleaved.balance or []) == 4 and sum(interleaved.balance or []) == 9


class Fork(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(x), x * 2


INFERENCE_MODE_CASES = (("1f1b", "gloo"), ("zb-h1", "ordered"))
INFERENCE_MODE_CALLS = ["inference_mode", "step after it", "an inference tensor",
                        "inference_mode again"]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_inference_mode_then_training_in_one_process(schedule: str) -> None:
    """pipe(x) under torch.inference_mode() is the model's output, and leaves nothing
    behind that a training step after it would trip on."""
    model = inference_workers.small_model()
    plain = copy.deepcopy(model)
    pipe = Pipe(model, 3, stages=2, schedule=schedule, loss_fn=nn.MSELoss())
    rows = inference_workers.inference_then_training(pipe, model, plain)
    assert [call for call, _ in rows] == INFERENCE_MODE_CALLS
    assert all(difference < 1e-12 for _, difference in rows), rows


def test_inference_mode_then_training_on_two_ranks() -> None:
    """Under each transport: the pooled message buffers a call under inference_mode
    allocates are no inference tensors (a later step writes into them), and an inference
    tensor crosses as any other."""
    for rows in run_ranks(inference_workers.under_inference_mode, 2, INFERENCE_MODE_CASES,
                          timeout=240):
        assert [case for case, _, _ in rows] == [
            f"{schedule} {transport}" for schedule, transport in INFERENCE_MODE_CASES
            for _ in INFERENCE_MODE_CALLS]
        assert [call for _, call, _ in rows] == INFERENCE_MODE_CALLS * len(INFERENCE_MODE_CASES)
        assert all(difference < 1e-12 for _, _, difference in rows), rows
