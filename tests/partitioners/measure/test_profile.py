"""profile: relative times, bytes, tuple inputs and outputs, and a model left as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partitioners import LayerCost, LossCost, Profile, balance, profile


@pytest.fixture(autouse=True)
def one_thread():  # noqa: ANN201
    # Timings on a shared 2-core machine: a second OpenMP thread waits for a busy core.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_linear_eight_times_wider_measures_at_least_three_times_slower() -> None:
    torch.manual_seed(0)
    width = 256
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(5)], nn.Linear(width, 8 * width))
    costs = profile(model, torch.randn(128, width), repeat=5)
    normal = sorted(cost.forward for cost in costs[1:5])[len(costs[1:5]) // 2]
    normal_time = sorted(cost.time for cost in costs[1:5])[len(costs[1:5]) // 2]
    assert costs[-1].forward >= 3 * normal
    assert costs[-1].time >= 3 * normal_time
    assert costs[-1].param_bytes == 8 * costs[0].param_bytes  # 8x the weight and the bias
    for stages in (2, 3, 4):
        sizes = balance(costs, stages, by="time")
        assert sizes[-1] == 1, (stages, sizes, [cost.time for cost in costs])


def test_bytes_of_a_linear_and_a_relu() -> None:
    batch, width = 4, 8
    model = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU())
    linear, relu = profile(model, torch.randn(batch, width), warmup=0, repeat=1)
    assert linear == LayerCost(
        linear.forward, linear.backward,
        param_bytes=(width * 2 * width + 2 * width) * 4,
        activation_bytes=batch * 2 * width * 4,
        saved_bytes=batch * width * 4,  # its input; the weight is a parameter, not counted
        name="Linear",
        backward_input=linear.backward_input,  # the first layer: I stops at its product
        backward_weight=linear.backward_weight,
        # No input gradient: I captures the gradient entering the product, W reads it and
        # the input (split_backward.first_stage); was the whole graph (None).
        weight_bytes=batch * (2 * width + width) * 4,
        kept_input_bytes=batch * width * 4,
    )
    assert linear.output_bytes == linear.activation_bytes
    assert relu.param_bytes == 0
    assert relu.activation_bytes == batch * 2 * width * 4
    assert relu.saved_bytes == batch * 2 * width * 4  # its output
    assert relu.kept_input_bytes == 0 and relu.weight_bytes == 0  # W has nothing to read
    assert linear.forward > 0 and linear.backward > 0 and relu.time > 0


class Split(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[:, :3] * 2, x[:, 3:].exp()


class Join(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        left, right = pair
        return torch.cat([left, right.sin()], dim=1)


class Pairwise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 5)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, tokens = pair
        return self.linear(x), tokens


def test_tuple_inputs_and_outputs_flow_layer_to_layer() -> None:
    model = nn.Sequential(Split(), Join(), nn.Linear(5, 5))
    costs = profile(model, torch.randn(6, 5), warmup=0, repeat=2)
    assert [cost.name for cost in costs] == ["Split", "Join", "Linear"]
    assert costs[0].activation_bytes == 6 * 5 * 4
    # Split's input needs no gradient and it has no parameters: nothing to differentiate.
    assert costs[0].backward == costs[0].backward_input == costs[0].backward_weight == 0.0
    assert all(cost.backward > 0 and cost.backward_input > 0 for cost in costs[1:])
    # A tuple sample whose second tensor is integer: it passes through without a gradient.
    model = nn.Sequential(Pairwise(), Pairwise())
    sample = (torch.randn(2, 5), torch.zeros(2, 3, dtype=torch.int64))
    costs = profile(model, sample, warmup=0, repeat=1)
    assert costs[0].activation_bytes == 2 * 5 * 4 + 2 * 3 * 8
    assert costs[0].param_bytes == 30 * 4


def test_model_is_left_as_it_was() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))
    model.eval()
    model[1].train()  # a mixed state, restored module by module
    model[0].weight.grad = torch.full_like(model[0].weight, 7.0)
    grad = model[0].weight.grad
    weight_storage = model[0].weight.data_ptr()
    state = {name: value.clone() for name, value in model.state_dict().items()}
    sample = torch.randn(8, 4)
    rng = torch.get_rng_state()

    profile(model, sample, warmup=1, repeat=2)

    assert [module.training for module in model] == [False, True, False, False]
    assert model.training is False
    assert model[0].weight.grad is grad and torch.equal(grad, torch.full_like(grad, 7.0))
    assert model[3].weight.grad is None and model[1].weight.grad is None
    assert model[0].weight.data_ptr() == weight_storage
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name  # running stats included
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profiling_on_cuda_moves_the_model_back() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    costs = profile(model, torch.randn(16, 64), device="cuda")
    assert len(costs) == 3 and all(cost.time > 0 for cost in costs[::2])
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_progress_bar_on_request_only(capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    profile(model, torch.randn(1, 2), warmup=0, repeat=1)  # stderr is not a terminal here
    assert capsys.readouterr().err == ""
    profile(model, torch.randn(1, 2), warmup=0, repeat=1, progress=True)
    assert "profile" in capsys.readouterr().err


class MulInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2.0)


@pytest.mark.parametrize(
    "middle",
    [nn.ReLU(inplace=True), nn.Dropout(0.5, inplace=True), MulInPlace()],
    ids=["relu", "dropout", "mul_"],
)
def test_in_place_layers_after_the_first(middle: nn.Module) -> None:
    model = nn.Sequential(nn.Linear(8, 8), middle, nn.Linear(8, 8))
    costs = profile(model, torch.randn(4, 8), warmup=1, repeat=1)
    assert [cost.name for cost in costs] == ["Linear", type(middle).__name__, "Linear"]
    assert costs[1].activation_bytes == 4 * 8 * 4
    assert balance(costs, 2, by="time") in ([1, 2], [2, 1])


@pytest.mark.parametrize("requires_grad", [False, True])
def test_the_sample_is_never_written_to(requires_grad: bool) -> None:
    model = nn.Sequential(nn.ReLU(inplace=True), MulInPlace(), nn.Linear(8, 8))
    sample = torch.randn(4, 8).requires_grad_(requires_grad)
    before = sample.detach().clone()
    costs = profile(model, sample, warmup=1, repeat=2)
    assert torch.equal(sample.detach(), before)
    assert sample.grad is None and sample.requires_grad is requires_grad
    assert len(costs) == 3


def tied_model() -> nn.Sequential:
    embedding = nn.Embedding(10, 8)
    head = nn.Linear(8, 10, bias=False)
    head.weight = embedding.weight  # one Parameter object in two layers
    return nn.Sequential(embedding, nn.Linear(8, 8), head)


def test_a_shared_parameter_is_charged_to_its_first_layer_only() -> None:
    model = tied_model()
    costs = profile(model, torch.randint(0, 10, (4, 3)), warmup=0, repeat=1)
    assert [cost.param_bytes for cost in costs] == [10 * 8 * 4, (8 * 8 + 8) * 4, 0]
    unique = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(cost.param_bytes for cost in costs) == unique
    assert costs[2].activation_bytes == 4 * 3 * 10 * 4
    assert [cost.tied for cost in costs] == [(), (), ((0, 10 * 8 * 4),)]


@pytest.mark.parametrize(("schedule", "copy_on"), [("1f1b", 1), ("zb-v", None)])
def test_a_stage_holding_a_tied_layer_is_charged_its_own_copy(schedule: str,
                                                              copy_on: int | None) -> None:
    # The runtime gives each stage that uses a shared weight a copy: the tied head on
    # stage 1 holds the embedding's weight too (1F1B), but not when the V puts the head
    # back on the embedding's stage (ZB-V). What the planner charges each stage must equal
    # the parameters its layers use, each once.
    from partitioners.plan.costs import candidate_costs, chunk_sums
    from partitioners import stage_memory
    from schedules import get_schedule

    embedding, middle, head = tied_model()
    model = nn.Sequential(embedding, middle, nn.ReLU(), head)
    costs = profile(model, torch.randint(0, 10, (4, 3)), warmup=0, repeat=1)
    timetable = get_schedule(schedule, 2, 2)
    cut = [1, 3] if timetable.chunks == 2 else [1, 1, 1, 1]
    sums = chunk_sums(costs, cut)
    fixed = candidate_costs(sums, (), "never", placement=timetable.placement).fixed_bytes
    per_stage = [0.0, 0.0]
    for chunk, stage in enumerate(timetable.placement):
        per_stage[stage] += fixed[chunk]
    layers_of = [[], []]
    start = 0
    for chunk, size in enumerate(cut):
        layers_of[timetable.placement[chunk]] += list(model)[start:start + size]
        start += size
    truth = [2 * sum(p.numel() * p.element_size()
                     for p in {id(p): p for layer in layers for p in layer.parameters()}.values())
             for layers in layers_of]
    assert per_stage == truth
    embedding = 10 * 8 * 4
    if copy_on is not None:
        assert per_stage[copy_on] == 2 * ((8 * 8 + 8) * 4 + embedding)
        assert stage_memory(costs, cut, [0.0, 0.0]) == truth


def test_a_device_this_machine_lacks_is_a_value_error() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"'cuda:99'.*expected a CUDA index below"):
            profile(model, torch.randn(1, 2), device="cuda:99")
    else:
        with pytest.raises(ValueError, match=r"device 'cuda'.*CUDA is not available"):
            profile(model, torch.randn(1, 2), device="cuda")
    with pytest.raises(ValueError, match=r"expected a device such as 'cpu'.*'nowhere'"):
        profile(model, torch.randn(1, 2), device="nowhere")


def test_errors_say_what_was_expected() -> None:
    empty = "expected an nn.Sequential with at least one layer, got an empty one"
    with pytest.raises(ValueError, match=empty):
        profile(nn.Sequential(), torch.randn(1, 2))
    with pytest.raises(TypeError, match="expected an nn.Sequential, got Linear"):
        profile(nn.Linear(2, 2), torch.randn(1, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"a tensor, or a tuple or dict of tensors .*got list \(of float\)"):
        profile(nn.Sequential(nn.ReLU()), [[1.0]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="repeat must be an int >= 1, got 0"):
        profile(nn.Sequential(nn.ReLU()), torch.randn(1), repeat=0)
    with pytest.raises(ValueError, match="warmup must be an int >= 0, got -1"):
        profile(nn.Sequential(nn.ReLU()), torch.randn(1), warmup=-1)
    with pytest.raises(RuntimeError, match=r"profiling layer 1 \(Linear\) failed"):
        profile(nn.Sequential(nn.Linear(2, 3), nn.Linear(2, 2)), torch.randn(1, 2))


class HeavyInput(nn.Module):
    """The input gradient is costly (matmuls through a fixed matrix), the weight's trivial."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mix", torch.randn(width, width) / width**0.5)
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(12):
            x = x @ self.mix
        return x + self.bias


class HeavyWeight(nn.Module):
    """The weight gradient is costly (matmuls of the weight), the input's trivial."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        for _ in range(12):
            w = w @ self.weight
        return x + w[0]


def test_split_backward_times_the_input_and_weight_gradients_apart() -> None:
    torch.manual_seed(0)
    width = 192
    model = nn.Sequential(nn.Identity(), HeavyInput(width), HeavyWeight(width), nn.ReLU())
    costs = profile(model, torch.randn(width, width), warmup=1, repeat=5)
    heavy_input, heavy_weight, relu = costs[1], costs[2], costs[3]
    # 12-22x apart when the machine is quiet (CI runs 2 cores); 3x leaves room for a busy one (it failed
    # at 5x once, with four other processes computing), and a swap of I and W gives < 1.
    assert heavy_input.backward_input > 3 * heavy_input.backward_weight, heavy_input
    assert heavy_weight.backward_weight > 3 * heavy_weight.backward_input, heavy_weight
    assert relu.backward_weight == 0.0 and relu.backward_input > 0
    assert costs[0].backward_input == 0.0  # the sample needs no gradient


def test_costs_at_a_micro_batch_size() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    batch = torch.randn(64, 8)
    whole = profile(model, batch, warmup=0, repeat=1)
    assert isinstance(whole, Profile) and isinstance(whole, list)
    assert whole.microbatch_size == 64 and whole.loss is None and whole.device == "cpu"
    part = profile(model, batch, warmup=0, repeat=1, microbatch_size=8)
    assert part.microbatch_size == 8
    assert [c.output_bytes for c in part] == [8 * 16 * 4, 8 * 16 * 4, 8 * 4 * 4]
    assert [c.saved_bytes for c in part] == [8 * 8 * 4, 8 * 16 * 4, 8 * 16 * 4]
    # 64 rows into 3 micro-batches: the largest, the first, has 22 (torch.tensor_split).
    split = profile(model, batch, warmup=0, repeat=1, microbatches=3)
    assert split.microbatch_size == 22 and split[0].output_bytes == 22 * 16 * 4


def test_loss_time_is_measured_apart_and_the_target_is_cut_too() -> None:
    model = nn.Sequential(nn.Linear(8, 10))
    batch, target = torch.randn(32, 8), torch.randint(0, 10, (32,))
    seen: list[tuple[int, int]] = []

    def loss_fn(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seen.append((output.shape[0], labels.shape[0]))
        return nn.functional.cross_entropy(output, labels)

    costs = profile(model, batch, warmup=0, repeat=2, microbatches=4, loss_fn=loss_fn,
                    target=target)
    assert isinstance(costs.loss, LossCost)
    assert costs.loss.forward > 0 and costs.loss.backward > 0
    assert seen == [(8, 8)] * 3  # one untimed run counts the bytes it saves, then 2 timed
    # Cross-entropy keeps the log-softmax of its 8 x 10 logits for its backward.
    assert costs.loss.saved_bytes == pytest.approx(8 * 10 * 4, abs=64)
    weighted = nn.CrossEntropyLoss(weight=torch.ones(10))
    assert profile(model, batch, loss_fn=weighted, target=target, repeat=1).loss is not None
    assert weighted.weight.device.type == "cpu"


def broken_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    raise ValueError("no labels")


@pytest.mark.parametrize(
    ("options", "error", "pattern"),
    [
        ({"microbatch_size": 65}, ValueError, r"microbatch_size=65 is more than the sample's 64"),
        ({"microbatches": 65}, ValueError, r"64 rows cannot be split into 65 micro-batches"),
        ({"microbatches": 0}, ValueError, r"microbatches must be an int >= 1, got 0"),
        ({"microbatches": 2, "microbatch_size": 2}, ValueError, r"not both"),
        ({"loss_fn": nn.MSELoss()}, ValueError, r"got loss_fn without a target"),
        ({"target": torch.zeros(64)}, ValueError, r"got a target without loss_fn"),
        ({"loss_fn": 3, "target": torch.zeros(64)}, TypeError, r"loss_fn must be callable"),
        ({"loss_fn": nn.MSELoss(), "target": torch.zeros(63, 4), "microbatches": 2},
         ValueError, r"target must have the sample's 64 rows .* got 63"),
        ({"loss_fn": broken_loss, "target": torch.zeros(64)}, RuntimeError,
         r"profiling the loss \(broken_loss\) on the last layer's output failed: no labels"),
    ],
)
def test_micro_batch_and_loss_errors(options: dict, error: type, pattern: str) -> None:
    model = nn.Sequential(nn.Linear(8, 4))
    with pytest.raises(error, match=pattern):
        profile(model, torch.randn(64, 8), warmup=0, repeat=1, **options)


@pytest.mark.parametrize("inplace", [False, True])
def test_a_tensor_two_neighbours_save_counts_once_in_a_chunk(inplace: bool) -> None:
    from partitioners.measure.cost import saved_bytes_of
    from partitioners.measure.tensors import SavedBytes, storage_pointers

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(inplace=inplace), nn.Linear(64, 64),
                          nn.Tanh(), nn.Linear(64, 8))
    x = torch.randn(8, 16)
    layers = list(profile(model, x, warmup=0, repeat=1, progress=False))
    assert layers[2].shared_input_bytes == 8 * 64 * 4  # the ReLU's output, the Linear's input
    for first in range(len(layers)):
        for end in range(first + 1, len(layers) + 1):
            chunk = model[first:end]
            counter = SavedBytes(exclude=storage_pointers(chunk))
            inputs = model[:first](x).detach().clone().requires_grad_(first > 0)
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                chunk(inputs.clone() if inplace else inputs)
            assert saved_bytes_of(layers[first:end]) == counter.total, (first, end)


@pytest.mark.parametrize("path", ["graph", "layers"])
def test_i_and_w_are_those_of_the_split_the_runtime_runs(path: str) -> None:
    """The first layer's input needs no gradient: the graph split's I stops at its product
    (``split_backward.first_stage``) and a Linear that defers its weight gradient runs I
    (nothing): both keep for W exactly its input and its output's gradient (the graph
    split kept the whole graph: weight_bytes None). profile(split_backward=...) measures
    the path asked for, and leaves the model's layers as they were."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    costs = profile(model, torch.randn(8, 16), warmup=1, repeat=2, split_backward=path)
    assert costs[0].weight_bytes == (8 * 16 + 8 * 32) * 4
    assert costs[2].weight_bytes == (8 * 32 + 8 * 8) * 4
    assert not any("forward" in module.__dict__ for module in model)
