"""Bad input gets an error saying what was expected and what was given; failures end cleanly."""

from __future__ import annotations

import copy
import re
import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from models import batch, build, grads, max_difference, reference
from pipeline import Pipe, StageError
from schedules import ScheduleError, one_f_one_b


def stage_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pipesched")]


@pytest.fixture(autouse=True)
def no_thread_left_behind() -> Iterator[None]:
    yield
    assert stage_threads() == [], "a stage thread outlived the call"


def mlp() -> nn.Sequential:
    return build("mlp")  # 9 layers


# -- construction -------------------------------------------------------------------------


def test_model_that_is_not_sequential() -> None:
    class Net(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(ValueError, match=r"needs sample=.* to cut a Net"):
        Pipe(Net(), 2, stages=1)  # any module is traced, with a sample (tests/units/)
    with pytest.raises(TypeError, match=r"got a ModuleList \(it has no forward\)"):
        Pipe(nn.ModuleList([nn.Linear(2, 2)]), 2, stages=1)
    with pytest.raises(TypeError, match=r"needs an nn\.Module.*got int"):
        Pipe(3, 2, stages=1)  # type: ignore[arg-type]


def test_empty_sequential() -> None:
    with pytest.raises(ValueError, match="at least one layer"):
        Pipe(nn.Sequential(), 2, stages=1)


def test_balance_that_does_not_sum_to_the_layers() -> None:
    with pytest.raises(ValueError, match=r"sum to the model's 9 layers, got \[4, 4\] \(sum 8\)"):
        Pipe(mlp(), 2, balance=[4, 4])
    with pytest.raises(ValueError, match=r"sum to the model's 9 layers, got \[5, 5\] \(sum 10\)"):
        Pipe(mlp(), 2, balance=[5, 5], devices=["cpu", "cpu"])


def test_balance_with_the_wrong_number_of_entries_or_bad_entries() -> None:
    with pytest.raises(ValueError, match=r"one entry per model chunk: expected 2, got 3"):
        Pipe(mlp(), 2, balance=[3, 3, 3], stages=2)
    with pytest.raises(ValueError, match=r"ints >= 1, got \[9, 0\]"):
        Pipe(mlp(), 2, balance=[9, 0])
    # Interleaved 1F1B: two chunks per stage, so 2 x stages entries.
    with pytest.raises(ValueError, match=r"expected 4, got 2"):
        Pipe(mlp(), 2, balance=[4, 5], stages=2, schedule="interleaved-1f1b")
    with pytest.raises(ValueError, match=r"unknown balance 'fast'"):
        Pipe(mlp(), 2, balance="fast", stages=2)


def test_devices_disagreeing_with_the_stage_count() -> None:
    with pytest.raises(ValueError, match=r"len\(devices\)=3.*stages=2"):
        Pipe(mlp(), 2, devices=["cpu"] * 3, stages=2)
    # The balance asks for 2 stages, the devices for 3.
    with pytest.raises(ValueError, match=r"expected 3, got 2"):
        Pipe(mlp(), 2, balance=[4, 5], devices=["cpu"] * 3)


@pytest.mark.parametrize("chunks", [0, -1, 2.0, True])
def test_chunks_below_one_or_not_an_int(chunks: object) -> None:
    expected = rf"chunks must be an int >= 1, got {re.escape(repr(chunks))}"
    with pytest.raises(ValueError, match=expected):
        Pipe(mlp(), chunks, stages=2)  # type: ignore[arg-type]


def test_unknown_checkpoint_mode() -> None:
    with pytest.raises(ValueError, match=r"unknown checkpoint mode 'sometimes'; expected one of: "
                                         r"never, except_last, always"):
        Pipe(mlp(), 2, stages=2, checkpoint="sometimes")  # type: ignore[arg-type]


def test_unknown_schedule_name() -> None:
    with pytest.raises(ValueError, match=r"unknown schedule 'pipedream'; expected one of: "
                                         r"gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, zb-v"):
        Pipe(mlp(), 2, stages=2, schedule="pipedream")


def test_schedule_built_for_other_counts() -> None:
    with pytest.raises(ValueError, match=r"built for stages=2, microbatches=8, but this Pipe has "
                                         r"stages=2, chunks=4"):
        Pipe(mlp(), 4, schedule=one_f_one_b(2, 8))
    with pytest.raises(ValueError, match=r"schedule\.stages=2.*stages=3"):
        Pipe(mlp(), 8, schedule=one_f_one_b(2, 8), stages=3)


def test_more_stages_than_layers() -> None:
    with pytest.raises(ValueError, match=r"cannot cut 9 layers into 10 model chunks: expected at "
                                         r"most 9"):
        Pipe(mlp(), 2, stages=10)
    # Two chunks per stage: 5 stages need 10 layers.
    with pytest.raises(ValueError, match=r"cannot cut 9 layers into 10 model chunks"):
        Pipe(mlp(), 2, stages=5, schedule="zb-v")


def test_no_stage_count_on_a_machine_without_gpus() -> None:
    if torch.cuda.is_available():
        pytest.skip("with GPUs the default is one stage per device")
    with pytest.raises(ValueError, match=r"cannot tell how many stages"):
        Pipe(mlp(), 2)


def test_schedule_that_is_neither_a_name_nor_a_schedule() -> None:
    with pytest.raises(TypeError, match=r"schedule must be a name or a Schedule, got int"):
        Pipe(mlp(), 2, stages=2, schedule=3)  # type: ignore[arg-type]


# -- calls --------------------------------------------------------------------------------


def test_batch_smaller_than_chunks() -> None:
    pipe = Pipe(mlp(), 4, stages=2, loss_fn=nn.MSELoss())
    x, target = batch("mlp", 3)
    message = r"a batch of 3 rows cannot be split into 4 micro-batches.*at least 4 rows"
    with pytest.raises(ValueError, match=message):
        pipe.step(x, target)
    with pytest.raises(ValueError, match=message):
        pipe(x)


def test_step_without_loss_fn() -> None:
    pipe = Pipe(mlp(), 2, stages=2)
    x, target = batch("mlp", 4)
    with pytest.raises(ValueError, match=r"step\(\) needs a loss_fn"):
        pipe.step(x, target)
    assert torch.allclose(pipe(x), pipe.model(x))  # inference needs none


def test_target_split_differently_from_x() -> None:
    pipe = Pipe(mlp(), 2, stages=2, loss_fn=nn.MSELoss())
    x, _ = batch("mlp", 6)
    _, target = batch("mlp", 5)
    with pytest.raises(ValueError, match=r"same micro-batch sizes, got \[3, 3\] and \[3, 2\]"):
        pipe.step(x, target)


def test_presplit_list_of_the_wrong_length() -> None:
    pipe = Pipe(mlp(), 3, stages=2, loss_fn=nn.MSELoss())
    x, target = batch("mlp", 6)
    with pytest.raises(ValueError, match=r"one entry per micro-batch: expected 3, got 2"):
        pipe.step(list(x.split(3)), list(target.split(3)))


def test_loss_fn_returning_a_vector() -> None:
    with pytest.raises(ValueError, match=r"MSELoss\(reduction='none'\) gives a loss per element"):
        Pipe(mlp(), 2, stages=2, loss_fn=nn.MSELoss(reduction="none"))
    pipe = Pipe(mlp(), 2, stages=2, loss_fn=lambda out, t: (out - t) ** 2)
    x, target = batch("mlp", 6)
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar, got a tensor of shape "
                                         r"\(3, 3\)"):
        pipe.step(x, target)


# -- failures inside a stage --------------------------------------------------------------


def width_sensitive_model() -> nn.Sequential:
    """Layers 0-4 take any width; layer 5 (stage 2 of 4) needs 6 features."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Tanh(), nn.Identity(), nn.Softsign(), nn.Tanh(), nn.Identity(),
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3),
    ).double()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"])
def test_shape_mismatch_in_layer_5_names_stage_layer_and_microbatch(schedule: str) -> None:
    model = width_sensitive_model()
    good_x, target = batch("mlp", 13)
    _, expected = reference(model, good_x, target, nn.MSELoss())
    balance = [2, 2, 2, 2] if schedule not in ("interleaved-1f1b", "zb-v") else [1] * 8
    pipe = Pipe(model, 4, balance=balance, schedule=schedule, loss_fn=nn.MSELoss(), timeout=20)
    stage = pipe.schedule.placement[2 if len(balance) == 4 else 5]
    bad_x = torch.randn(13, 7, dtype=torch.float64)
    with pytest.raises(StageError) as raised:
        pipe.step(bad_x, target)
    message = str(raised.value)
    assert f"stage {stage}, layer 5 (Linear), micro-batch 0" in message
    assert "7" in message and "6" in message  # what the layer got and what it needed
    assert stage_threads() == []
    # The same Pipe then runs a correct step, with the reference gradients.
    pipe.zero_grad()
    pipe.step(good_x, target)
    assert max_difference(grads(model), expected) < 1e-10


class FailOnNonFinite(nn.Module):
    """Raises when its input holds inf: a failure of one chosen micro-batch mid-step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.isfinite(x).all():
            raise FloatingPointError("non-finite input")
        return x


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h2"])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_failure_mid_step_leaves_the_pipe_usable(schedule: str, checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 8), nn.Linear(8, 8), nn.Identity(), FailOnNonFinite(), nn.Tanh(),
        nn.Linear(8, 3),
    ).double()
    x, target = batch("mlp", 12)
    _, expected = reference(model, x, target, nn.MSELoss())
    pipe = Pipe(copy.deepcopy(model), 4, stages=3, schedule=schedule, checkpoint=checkpoint,
                loss_fn=nn.MSELoss(), timeout=20)
    bad = x.clone()
    bad[7, 0] = float("inf")  # row 7: micro-batch 2 of 4
    with pytest.raises(StageError, match=r"stage 1, layer 3 \(FailOnNonFinite\), micro-batch 2: "
                                         r"FloatingPointError: non-finite input"):
        pipe.step(bad, target)
    assert stage_threads() == []
    pipe.zero_grad()
    loss = pipe.step(x, target)
    assert torch.isfinite(loss)
    assert max_difference(grads(pipe.model), expected) < 1e-10


def test_failing_loss_fn_is_reported_as_a_stage_error() -> None:
    pipe = Pipe(mlp(), 2, stages=3, loss_fn=nn.MSELoss(), timeout=20)
    x, _ = batch("mlp", 6)
    wrong = torch.randn(6, 5, dtype=torch.float64)
    with pytest.raises(StageError, match=r"stage 2, loss_fn, micro-batch 0"):
        with pytest.warns(UserWarning):  # MSELoss warns about broadcasting first
            pipe.step(x, wrong)


def test_failure_during_inference_is_a_stage_error() -> None:
    pipe = Pipe(width_sensitive_model(), 3, stages=4, timeout=20)
    with pytest.raises(StageError, match=r"stage 2, layer 5 \(Linear\), micro-batch 0"):
        pipe(torch.randn(6, 7, dtype=torch.float64))
    assert pipe(torch.randn(6, 6, dtype=torch.float64)).shape == (6, 3)


def test_schedule_errors_are_value_errors() -> None:
    # One except clause catches every bad-input error of the package.
    assert issubclass(ScheduleError, ValueError)
    assert issubclass(StageError, RuntimeError)


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        if FailInBackward.armed:
            raise ArithmeticError("backward refused")
        return grad


class FailInBackward(nn.Module):
    """Identity whose backward raises while ``FailInBackward.armed`` is set."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FailingBackward.apply(x)


@pytest.mark.parametrize(("schedule", "op"), [("1f1b", "B"), ("gpipe", "B"), ("zb-h1", "I")])
def test_failure_in_a_backward_names_stage_and_microbatch(
    schedule: str, op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), FailInBackward(), nn.Tanh(), nn.Linear(8, 3)
    ).double()
    x, target = batch("mlp", 12)
    _, expected = reference(model, x, target, nn.MSELoss())
    pipe = Pipe(model, 4, stages=3, schedule=schedule, loss_fn=nn.MSELoss(), timeout=20)
    monkeypatch.setattr(FailInBackward, "armed", True)
    first = next(a.microbatch for a in pipe.schedule.order[1] if a.op.name == op)
    with pytest.raises(StageError, match=rf"stage 1, chunk 1 \(layers from 2\), micro-batch "
                                         rf"{first}, {op}: ArithmeticError: backward refused"):
        pipe.step(x, target)
    assert stage_threads() == []
    monkeypatch.setattr(FailInBackward, "armed", False)
    pipe.zero_grad()
    pipe.step(x, target)
    assert max_difference(grads(model), expected) < 1e-10


def test_missing_x_or_target_in_one_process() -> None:
    """Only a rank of a group may leave x or target out; in one process both are needed."""
    pipe = Pipe(mlp(), 2, stages=2, loss_fn=nn.MSELoss())
    x, target = batch("mlp", 4)
    with pytest.raises(ValueError, match=r"needs.*target.*got target=None"):
        pipe.step(x, None)
    with pytest.raises(ValueError, match=r"needs.*x.*got x=None"):
        pipe.step(None, target)
    with pytest.raises(ValueError, match=r"needs x and target"):
        pipe.step(None, None)
    with pytest.raises(ValueError, match=r"needs an input.*got None"):
        pipe(None)


def test_an_unknown_keyword_is_pythons_own_type_error_naming_it() -> None:
    model = mlp()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'data_group'"):
        Pipe(model, 2, stages=2, data_group=object())  # type: ignore[call-arg]
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


def test_the_process_layout_is_said_once() -> None:
    from pipeline import Distributed

    with pytest.raises(ValueError, match=r"^pass one of distributed=, mesh= or group= \(each says "
                                         r"the whole process layout\), got mesh=, group=$"):
        Pipe(mlp(), 2, stages=2, mesh=object(), group=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Distributed.group: expected a torch.distributed "
                                        "ProcessGroup, got str"):
        Distributed("world")  # type: ignore[arg-type]
