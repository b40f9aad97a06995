"""The layers real models use, in the one-process runtime: in-place ops, functional randomness,
BatchNorm, tied weights, input gradients, structured and complex payloads, autocast."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from models import structured_model, tied_head

from pipeline import Pipe
from schedules import Action, Op, Schedule, ScheduleError, one_f_one_b

TOLERANCE = 1e-10
MODES = ("always", "except_last", "never")
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2")


class Scale(nn.Module):
    """Multiplies its input in place: the kind of layer that broke stage inputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(0.5)


class DropPath(nn.Module):
    """Stochastic depth with torch.rand: randomness outside nn.Dropout."""

    def __init__(self, width: int, p: float = 0.3) -> None:
        super().__init__()
        self.p = p
        self.inner = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = (torch.rand(x.shape[0], 1, dtype=x.dtype) > self.p).to(x.dtype) / (1 - self.p)
        noise = torch.bernoulli(torch.full_like(x, 0.8))
        return x + self.inner(nn.functional.dropout(x, 0.2, self.training)) * keep * noise


def _check_grads(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        assert torch.allclose(p.grad, q.grad, atol=TOLERANCE, rtol=0), name


def _inplace_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.ReLU(inplace=True), nn.Linear(6, 8), Scale(), nn.Linear(8, 8),
        nn.ReLU(inplace=True), nn.Linear(8, 8), nn.Dropout(0.0, inplace=True), nn.Linear(8, 3),
    ).double()


@pytest.mark.parametrize(("schedule", "checkpoint"), list(itertools.product(SCHEDULES, MODES)))
def test_in_place_layers_first_in_the_model_and_in_every_stage(schedule: str, checkpoint: str) -> None:
    model = _inplace_model()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.randn(8, 3, dtype=torch.float64)
    kept = x.clone()
    nn.MSELoss()(reference(x.clone()), y).backward()
    pipe = Pipe(model, chunks=4, balance=[2, 2, 2, 2], devices=["cpu"] * 4, schedule=schedule,
                checkpoint=checkpoint, loss_fn=nn.MSELoss())
    pipe.step(x, y)
    assert torch.equal(x, kept), "the user's x was modified"
    _check_grads(model, reference)


def _random_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), DropPath(8), nn.Tanh(), DropPath(8), DropPath(8),
                         nn.Linear(8, 3)).double()


def test_functional_randomness_is_the_same_in_every_schedule_and_checkpoint_mode() -> None:
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.randn(8, 3, dtype=torch.float64)
    results = []
    for schedule, checkpoint, balance in [
        ("gpipe", "never", [2, 4]), ("1f1b", "always", [3, 3]), ("zb-h1", "except_last", [2, 4]),
        ("interleaved-1f1b", "always", [1, 2, 2, 1]), ("zb-v", "never", [2, 1, 1, 2]),
    ]:
        model = _random_model()
        torch.manual_seed(42)
        pipe = Pipe(model, chunks=4, balance=balance, devices=["cpu", "cpu"], schedule=schedule,
                    checkpoint=checkpoint, loss_fn=nn.MSELoss())
        loss = pipe.step(x, y)
        results.append((schedule, checkpoint, loss, [p.grad.clone() for p in model.parameters()]))
    _, _, first_loss, first_grads = results[0]
    for schedule, checkpoint, loss, grads in results[1:]:
        assert abs(loss.item() - first_loss.item()) < TOLERANCE, (schedule, checkpoint)
        for g, h in zip(grads, first_grads):
            assert torch.allclose(g, h, atol=TOLERANCE, rtol=0), (schedule, checkpoint)


def test_randomness_changes_from_step_to_step_and_repeats_with_the_seed() -> None:
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.randn(8, 3, dtype=torch.float64)
    pipe = Pipe(_random_model(), chunks=4, balance=[3, 3], devices=["cpu", "cpu"],
                checkpoint="always", loss_fn=nn.MSELoss())
    torch.manual_seed(1)
    first, second = pipe.step(x, y).item(), pipe.step(x, y).item()
    torch.manual_seed(1)
    assert pipe.step(x, y).item() == first and first != second


def _bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(inplace=True),
                         nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 3)).double()


def _norm_state(model: nn.Module) -> list[torch.Tensor]:
    return [b for name, b in model.named_buffers()]


@pytest.mark.parametrize("checkpoint", MODES)
def test_batch_norm_counts_each_microbatch_once_under_recomputation(checkpoint: str) -> None:
    model = _bn_model()
    reference = copy.deepcopy(model)
    x = torch.randn(12, 6, dtype=torch.float64)
    for part in torch.tensor_split(x, 3):
        reference(part)
    pipe = Pipe(model, chunks=3, balance=[3, 3], devices=["cpu", "cpu"], checkpoint=checkpoint,
                loss_fn=nn.MSELoss())
    pipe.step(x, torch.randn(12, 3, dtype=torch.float64))
    assert int(model[1].num_batches_tracked) == 3
    for mine, theirs in zip(_norm_state(model), _norm_state(reference)):
        assert torch.allclose(mine.double(), theirs.double(), atol=TOLERANCE, rtol=0)


def _deferred_reference(model: nn.Module, x: torch.Tensor, chunks: int) -> None:
    """Running statistics as deferred BatchNorm defines them, computed independently: each
    BatchNorm's inputs over all micro-batches (each normalised by its own statistics), one
    momentum update per step. For the first BatchNorm these are the full batch's statistics."""
    seen: dict[nn.Module, list[torch.Tensor]] = {}
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    for norm in norms:
        norm.register_forward_pre_hook(lambda m, inputs: seen.setdefault(m, []).append(inputs[0]))
        norm.track_running_stats = False
    for part in torch.tensor_split(x, chunks):
        model(part)
    with torch.no_grad():
        for norm in norms:
            values = torch.cat(seen[norm])
            norm.track_running_stats = True
            norm.num_batches_tracked += 1
            factor = norm.momentum if norm.momentum is not None else 1 / int(norm.num_batches_tracked)
            norm.running_mean.mul_(1 - factor).add_(values.mean(0) * factor)
            norm.running_var.mul_(1 - factor).add_(values.var(0) * factor)
    for norm in norms:
        norm._forward_pre_hooks.clear()


@pytest.mark.parametrize(("schedule", "checkpoint"), list(itertools.product(("1f1b", "zb-h1"), MODES)))
def test_deferred_batch_norm_updates_once_per_step_over_the_whole_batch(
        schedule: str, checkpoint: str) -> None:
    model = _bn_model()
    reference = copy.deepcopy(model)
    full_batch = copy.deepcopy(model)
    x = torch.randn(13, 6, dtype=torch.float64) * 3 + 5
    for _ in range(2):
        _deferred_reference(reference, x, 4)
    pipe = Pipe(model, chunks=4, balance=[2, 4], devices=["cpu", "cpu"], schedule=schedule,
                checkpoint=checkpoint, loss_fn=nn.MSELoss(), deferred_batch_norm=True)
    for _ in range(2):
        pipe.step(x, torch.randn(13, 3, dtype=torch.float64))
    assert int(model[1].num_batches_tracked) == int(model[4].num_batches_tracked) == 2
    for mine, theirs in zip(_norm_state(model), _norm_state(reference)):
        assert torch.allclose(mine.double(), theirs.double(), atol=TOLERANCE, rtol=0)
    for _ in range(2):
        full_batch(x)  # the first BatchNorm sees the same inputs as in one full-batch forward
    for mine, theirs in zip(_norm_state(model[1]), _norm_state(full_batch[1])):
        assert torch.allclose(mine.double(), theirs.double(), atol=TOLERANCE, rtol=0)


def _tied_model() -> nn.Sequential:
    torch.manual_seed(0)
    return tied_head(8)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-h2", "zb-v"])
def test_a_weight_tied_across_stages_gets_its_full_gradient_every_time(schedule: str) -> None:
    tokens = torch.randint(0, 11, (16, 5))
    targets = torch.randint(0, 11, (16, 5))

    def lm_loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())

    reference = _tied_model()
    lm_loss(reference(tokens), targets).backward()
    per_stage = 2 if schedule == "zb-v" else 1
    balance = [2, 1, 1, 1] if per_stage == 2 else [2, 3]
    for _ in range(6):  # the race showed in 14-19% of steps
        model = _tied_model()
        pipe = Pipe(model, chunks=8, balance=balance, devices=["cpu", "cpu"], schedule=schedule,
                    checkpoint="never", loss_fn=lm_loss)
        pipe.step(tokens, targets)
        assert model[0].weight is model[4].weight
        assert torch.allclose(model[0].weight.grad, reference[0].weight.grad, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize(("schedule", "checkpoint"), list(itertools.product(("1f1b", "zb-h1"), MODES)))
def test_input_gradients_reach_x(schedule: str, checkpoint: str) -> None:
    model = _inplace_model()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    x_reference = x.detach().clone().requires_grad_()
    y = torch.randn(8, 3, dtype=torch.float64)
    nn.MSELoss()(reference(x_reference * 1), y).backward()
    pipe = Pipe(model, chunks=4, balance=[2, 6], devices=["cpu", "cpu"], schedule=schedule,
                checkpoint=checkpoint, loss_fn=nn.MSELoss())
    pipe.step(x, y)
    assert x.grad is not None
    assert torch.allclose(x.grad, x_reference.grad, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_structured_and_complex_payloads_between_stages(schedule: str, checkpoint: str) -> None:
    torch.manual_seed(0)
    model = structured_model()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.randn(8, 2, dtype=torch.float64)
    nn.MSELoss()(reference(x), y).backward()
    pipe = Pipe(model, chunks=4, balance=[1, 3, 1, 1], devices=["cpu"] * 4, schedule=schedule,
                checkpoint=checkpoint, loss_fn=nn.MSELoss())
    pipe.step(x, y)
    _check_grads(model, reference)
    with torch.no_grad():
        assert torch.allclose(pipe(x), reference(x), atol=TOLERANCE, rtol=0)


def test_a_user_schedule_with_a_missing_action_is_refused_before_running() -> None:
    full = one_f_one_b(2, 2)
    broken = Schedule(2, 2, (full.order[0][:-1], full.order[1]), name="broken")
    with pytest.raises(ScheduleError, match=r"B1"):
        Pipe(_classifier_model(), chunks=2, balance=[1, 1], devices=["cpu", "cpu"],
             schedule=broken, loss_fn=nn.MSELoss())
    assert Action(Op.B, 1) not in broken.order[0]


def _classifier_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def test_autocast_and_saved_tensor_hooks_reach_every_stage() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_out = reference(x)
        nn.MSELoss()(expected_out.float(), y).backward()
    pipe = Pipe(model, chunks=2, balance=[2, 2], devices=["cpu", "cpu"], checkpoint="always",
                loss_fn=lambda out, t: nn.functional.mse_loss(out.float(), t))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert pipe(x).dtype == torch.bfloat16
    packed = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tensor.dtype)
        return tensor

    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pipe.step(x, y)
    assert torch.bfloat16 in packed, "saved-tensor hooks did not reach the stage threads"
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=2e-2, rtol=5e-2)


def test_bf16_parameters_and_a_grad_scaler_end_to_end() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.Linear(16, 4))
    model = model.to(torch.bfloat16)
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    y = torch.randn(8, 4, dtype=torch.bfloat16)
    nn.MSELoss()(reference(x), y).backward()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pipe = Pipe(model, chunks=4, balance=[2, 2], devices=["cpu", "cpu"], schedule="zb-h1",
                loss_fn=nn.MSELoss())
    loss = pipe.step(x, y, scaler=scaler)
    assert loss.dtype == torch.bfloat16 and abs(loss.item() - nn.MSELoss()(reference(x), y).item()) < 2e-2
    scaler.unscale_(optimizer)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.dtype == torch.bfloat16
        assert torch.allclose(p.grad.float(), q.grad.float(), atol=2e-2, rtol=5e-2)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    optimizer.zero_grad()
    huge = torch.amp.GradScaler("cpu", init_scale=2.0**120)
    pipe.step(x * 1e30, y, scaler=huge)  # gradients this large are not finite once scaled
    huge.step(optimizer)  # skipped: the gradients are not finite
    after = [p.detach().clone() for p in model.parameters()]
    huge.update()
    assert huge.get_scale() < 2.0**120
    assert all(torch.equal(a, p) for a, p in zip(after, model.parameters()))
