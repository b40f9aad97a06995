"""Measured activation memory follows the schedule: micro-batches held, bytes, lifetimes."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from models import batch, build
from pipeline import Pipe
from pipeline.compute.microbatch import split
from schedules import simulate

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")
MODES = ("always", "except_last", "never")


def step(schedule: str, checkpoint: str, stages: int, chunks: int, name: str = "mlp",
         rows: int = 16) -> Pipe:
    model = build(name)
    x, target = batch(name, rows)
    pipe = Pipe(model, chunks, stages=stages, schedule=schedule, checkpoint=checkpoint,
                loss_fn=nn.MSELoss())
    with pipe.measure_memory():
        pipe.step(x, target)
    return pipe


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_microbatches_held_match_the_simulator(schedule: str, checkpoint: str) -> None:
    for stages, chunks in ((4, 8), (2, 5), (3, 2)):
        pipe = step(schedule, checkpoint, stages, chunks)
        measured = tuple(report.peak_activations for report in pipe.memory)
        predicted = simulate(pipe.schedule).peak_activations
        assert measured == predicted, (
            f"{schedule} {checkpoint} P={stages} M={chunks}: measured {measured}, "
            f"simulated {predicted}"
        )


@pytest.mark.parametrize("checkpoint", MODES)
def test_gpipe_holds_all_and_1f1b_holds_stages_minus_stage(checkpoint: str) -> None:
    stages, chunks = 4, 8
    gpipe = step("gpipe", checkpoint, stages, chunks)
    assert [r.peak_activations for r in gpipe.memory] == [chunks] * stages
    one_f_one_b = step("1f1b", checkpoint, stages, chunks)
    assert [r.peak_activations for r in one_f_one_b.memory] == [stages - s for s in range(stages)]


# -- bytes, computed independently of the Pipe's tracker ----------------------------------


def saved_bytes(layers: nn.Sequential, x: torch.Tensor, first: bool,
                loss: tuple[nn.Module, torch.Tensor] | None, with_input: bool = False) -> int:
    """Bytes autograd saves running ``layers`` on ``x`` as a stage would (parameters excluded).

    A tensor saved twice (an output saved by its own op and by the next) counts once.
    With ``with_input``, the stage's input counts too, whether an op saves it or not.
    """
    parameters = {p.untyped_storage().data_ptr() for p in layers.parameters()}
    seen: set[tuple[Any, ...]] = set()
    sizes: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
               tuple(tensor.shape), tuple(tensor.stride()))
        if key[0] not in parameters and key not in seen:
            seen.add(key)
            sizes.append(tensor.numel() * tensor.element_size())
        return tensor.detach()  # not the tensor itself: a saved output would form a cycle

    inputs = x.detach().requires_grad_(not first)
    if with_input:
        pack(inputs)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = layers(inputs)
        if loss is not None:
            loss[0](output, loss[1])
    return sum(sizes)


def stage_figures(pipe: Pipe, x: torch.Tensor, target: torch.Tensor, chunks: int,
                  with_input: bool = False) -> list[tuple[list[int], list[int]]]:
    """Per stage and micro-batch: the bytes autograd saves (and the input, with
    ``with_input``), and the input's bytes; computed from scratch."""
    balance = pipe.balance
    assert balance is not None
    figures = []
    values = split(x, chunks)
    targets = split(target, chunks)
    first_layer = 0
    for stage, count in enumerate(balance):
        layers = nn.Sequential(*[pipe.model[i] for i in range(first_layer, first_layer + count)])
        last = stage == len(balance) - 1
        full, inputs = [], []
        for m, value in enumerate(values):
            full.append(saved_bytes(layers, value, stage == 0,
                                    (nn.MSELoss(), targets[m]) if last else None, with_input))
            inputs.append(value.numel() * value.element_size())
        with torch.no_grad():
            values = [layers(value) for value in values]
        figures.append((full, inputs))
        first_layer += count
    return figures


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_never_with_one_microbatch_saves_exactly_the_activations(stages: int) -> None:
    """The tracker counts what autograd saves, parameters (and views of them) excluded, and
    from the second stage on the stage's input, which the runtime keeps until the backward
    whether a layer saves it or not (a ReLU first in a stage does not). A later stage's
    layers get its input as it is (torch refuses a write to it before making it, see
    pipeline.compute.layer_run), so the input counts once; the first stage's run on a
    copy of the caller's x, which counts where the first layer saves it, as x would."""
    model = build("mlp")
    x, target = batch("mlp", 16)
    pipe = Pipe(model, 1, stages=stages, checkpoint="never", loss_fn=nn.MSELoss())
    with pipe.measure_memory():
        pipe.step(x, target)
    saved = stage_figures(pipe, x, target, 1)
    with_input = stage_figures(pipe, x, target, 1, with_input=True)
    expected = [saved[0][0][0]] + [full[0] for full, _ in with_input[1:]]
    assert [r.peak_bytes for r in pipe.memory] == expected


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("name", ["mlp", "residual_stack"])
def test_always_holds_one_full_microbatch_plus_the_inputs_of_the_others(
    schedule: str, name: str
) -> None:
    stages, chunks = 3, 6
    model = build(name)
    x, target = batch(name, 16)
    always = Pipe(model, chunks, stages=stages, schedule=schedule, checkpoint="always",
                  loss_fn=nn.MSELoss())
    never = Pipe(build(name), chunks, stages=stages, schedule=schedule, checkpoint="never",
                 loss_fn=nn.MSELoss())
    with always.measure_memory(), never.measure_memory():
        always.step(x, target)
        never.step(x, target)
    held = simulate(always.schedule).peak_activations
    # A micro-batch being recomputed holds all its activations and its input (which the
    # first layer may not save); each other micro-batch holds its input alone.
    figures = stage_figures(always, x, target, chunks, with_input=True)
    for stage, (full, inputs) in enumerate(figures):
        bound = max(full) + (int(held[stage]) - 1) * max(inputs)
        measured = always.memory[stage].peak_bytes
        assert measured <= bound, f"stage {stage}: {measured} bytes saved, bound {bound}"
        assert measured >= max(full), f"stage {stage}: less than one micro-batch's activations"
        assert measured <= never.memory[stage].peak_bytes, f"stage {stage}"
    total = [sum(r.peak_bytes for r in pipe.memory) for pipe in (always, never)]
    assert total[0] < total[1], f"recomputation saved nothing: {total}"


def test_except_last_sits_between_always_and_never() -> None:
    peaks = {mode: step("gpipe", mode, 2, 4).memory for mode in MODES}
    for stage in range(2):
        always, except_last, never = (peaks[m][stage].peak_bytes for m in MODES)
        assert always <= except_last < never


# -- nothing outlives the step ------------------------------------------------------------


class Recorder(nn.Tanh):
    """Tanh keeping weak references to its outputs, to see when they die."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[weakref.ref[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = super().forward(x)
        self.outputs.append(weakref.ref(output))
        return output


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_no_activation_outlives_the_step(schedule: str, checkpoint: str) -> None:
    torch.manual_seed(0)
    recorders = [Recorder() for _ in range(4)]
    layers: list[nn.Module] = []
    for recorder in recorders:
        layers += [nn.Linear(6, 6), recorder]
    model = nn.Sequential(*layers).double()
    x = torch.randn(8, 6, dtype=torch.float64)
    target = torch.randn(8, 6, dtype=torch.float64)
    pipe = Pipe(model, 4, stages=2, schedule=schedule, checkpoint=checkpoint, loss_fn=nn.MSELoss())
    with pipe.measure_memory():
        pipe.step(x, target)
        first = pipe.memory
        pipe.step(x, target)
    assert pipe.memory == first, "the measured peaks grow from step to step"
    gc.collect()
    alive = sum(ref() is not None for r in recorders for ref in r.outputs)
    assert alive == 0, f"{alive} activations of {schedule} ({checkpoint}) outlive the step"


def test_memory_is_measured_only_when_asked_for() -> None:
    pipe = Pipe(build("mlp"), 2, stages=2, loss_fn=nn.MSELoss())
    pipe.step(*batch("mlp", 4))
    with pytest.raises(ValueError, match=r"no step has run inside one"):
        pipe.memory
    with pipe.measure_memory():
        pipe.step(*batch("mlp", 4))
    measured = pipe.memory
    assert [report.peak_activations for report in measured] == [2.0, 1.0]  # 1F1B, P=2, M=2
    pipe.step(*batch("mlp", 4))  # not measured: the last measured step's figures stay
    assert pipe.memory == measured
    with pipe.measure_memory():
        with pipe.measure_memory():
            pass
        assert all(chunk.tracker is not None for chunk in pipe._runner.chunks.values()), \
            "an inner block's end stopped the outer block's measuring"
    assert all(chunk.tracker is None for chunk in pipe._runner.chunks.values())


def test_memory_is_measured_in_a_pipe_built_inside_measure_memory_and_a_time_balance() -> None:
    pipe = Pipe(build("mlp"), 2, balance="time", stages=2, loss_fn=nn.MSELoss())
    with pipe.measure_memory():  # the runner is built by this first step (balance="time")
        pipe.step(*batch("mlp", 4))
    assert [report.peak_activations for report in pipe.memory] == [2.0, 1.0]
