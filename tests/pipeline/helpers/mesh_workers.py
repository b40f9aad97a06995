"""Functions that run inside spawned gloo ranks for the 3D-mesh tests (importable by name).

Each builds a device mesh over the ranks, a Pipe on it (FSDP2 or replicated data
parallelism along ``"dp"``) and returns plain numbers: errors against the unpipelined
model on the union of the replicas' batches, bytes held, collectives counted.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import zoo
from examples.gpt import TENSOR_PARALLEL_BY_NAME, gpt, tensor_parallel_plan

CHUNKS = 4
SEED = 1234
# Layers per model chunk (9 layers: embedding, 6 blocks, norm, tied head) for 1 to 8
# chunks: the head is on another stage than the embedding, except under a V schedule,
# whose first stage runs both ends (one FSDP unit then holds both).
BALANCES = {1: [9], 2: [5, 4], 4: [3, 2, 2, 2], 8: [2, 1, 1, 1, 1, 1, 1, 1]}


def balance_for(schedule: str, stages: int) -> list[int]:
    from schedules import get_schedule

    return BALANCES[get_schedule(schedule, stages, CHUNKS).chunks]


HEADS = 4  # attention heads split over up to 4 tensor-parallel ranks
BLOCKS = 6  # 9 layers: room for 8 chunks of 4 stages under ZB-V


def mesh_gpt(seed: int = 0, drop_path: float = 0.0, dropout: float = 0.0) -> nn.Sequential:
    """The test GPT (``zoo.tiny_gpt``'s widths) with 6 blocks of 4 heads of 2 dimensions."""
    torch.manual_seed(seed)
    return gpt(zoo.VOCAB, zoo.DIM, BLOCKS, HEADS, zoo.SEQ, drop_path=drop_path,
               dropout=dropout).to(zoo.DTYPE)


def plan_for(shape: Sequence[int]) -> Any:
    """The GPT's tensor-parallel plan where the mesh (pp, dp[, tp]) has tp > 1, else None:
    at tp=4 the dict of its module names, else the function (both split alike)."""
    if len(shape) < 3 or shape[2] == 1:
        return None
    return TENSOR_PARALLEL_BY_NAME if shape[2] == 4 else tensor_parallel_plan


def union_batch_of(replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch all ``replicas`` train on together, each on its share of the rows."""
    return zoo.gpt_batch(rows=zoo.GPT_ROWS * replicas)


def mesh_of(shape: Sequence[int]) -> DeviceMesh:
    names = ("pp", "dp", "tp")[: len(shape)]
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)


def replica_batch(mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's rows of the union batch (every replica's the same size)."""
    x, y = union_batch(mesh)
    replicas = mesh["dp"].size() if "dp" in (mesh.mesh_dim_names or ()) else 1
    coordinate = mesh.get_local_rank("dp") if replicas > 1 else 0
    rows = x.shape[0] // replicas
    return x[coordinate * rows:(coordinate + 1) * rows], y[coordinate * rows:(coordinate + 1) * rows]


def union_batch(mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    return union_batch_of(mesh["dp"].size() if "dp" in (mesh.mesh_dim_names or ()) else 1)


def full_grads(model: nn.Sequential) -> dict[str, torch.Tensor]:
    """This rank's gradients by per-layer key, sharded ones gathered (replicas call alike)."""
    found = {}
    for key, parameter in zoo.per_layer_parameters(model).items():
        if parameter.is_meta:
            continue
        grad = parameter.grad
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        found[key] = grad if grad is not None else torch.full_like(_full(parameter), float("nan"))
    return found


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def worst(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max((zoo.difference(found[key], expected[key]) for key in found), default=float("inf"))


Combination = tuple[str, str, str]  # data parallelism, schedule, checkpoint mode


def gpt_exact(rank: int, world: int, shape: Sequence[int], combinations: Sequence[Combination],
              reshard_after_forward: bool = False) -> list[tuple[Combination, float, float, int]]:
    """Loss and gradient errors against the unpipelined GPT on the union batch, per
    combination: (combination, loss error, gradient error, parameters compared). (A model
    with dropout has no unpipelined twin: ``random_equal`` compares FSDP with replicas
    under one seed.)"""
    from pipeline import Distributed, Pipe

    torch.set_num_threads(1)
    mesh = mesh_of(shape)
    model = mesh_gpt()
    expected_loss, expected = zoo.reference_grads(model, *union_batch(mesh), zoo.gpt_loss())
    x, y = replica_batch(mesh)
    rows = []
    for combination in combinations:
        data_parallel, schedule, mode = combination
        trained = copy.deepcopy(model)
        pipe = Pipe(trained, CHUNKS, balance=balance_for(schedule, shape[0]), schedule=schedule,
                    checkpoint=mode, loss_fn=zoo.gpt_loss(),
                    distributed=Distributed.from_mesh(
                        mesh, data_parallel=data_parallel,
                        reshard_after_forward=reshard_after_forward,
                        tensor_parallel=plan_for(shape)),
                    timeout=60.0)
        loss = float(pipe.step(x, y))
        split = sum(isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())
                    for p in pipe.parameters())
        assert split > 0 or plan_for(shape) is None, "a plan that split nothing"
        found = full_grads(trained)
        rows.append((combination, abs(loss - expected_loss), worst(found, expected), len(found)))
        pipe.close()
    return rows


def random_equal(rank: int, world: int, shape: Sequence[int], schedule: str) -> float:
    """Dropout and stochastic depth under one seed: FSDP's gradients equal the replicated
    pipeline's (the largest difference)."""
    from pipeline import Distributed, Pipe

    torch.set_num_threads(1)
    mesh = mesh_of(shape)
    model = mesh_gpt(drop_path=0.1, dropout=0.1)
    x, y = replica_batch(mesh)
    found = []
    for data_parallel in ("replicate", "fsdp"):
        trained = copy.deepcopy(model)
        pipe = Pipe(trained, CHUNKS, balance=balance_for(schedule, shape[0]), schedule=schedule,
                    loss_fn=zoo.gpt_loss(),
                    distributed=Distributed.from_mesh(mesh, data_parallel=data_parallel),
                    timeout=30.0)
        torch.manual_seed(SEED)
        pipe.step(x, y)
        found.append(full_grads(trained))
        pipe.close()
    return worst(found[1], found[0])


def sharded_units(pipe: Any) -> int:
    """FSDP units on this rank (a layer, or layers sharing a parameter)."""
    return len(pipe._runner.data_parallel.shard_groups)


def collectives(rank: int, world: int, reshard_after_forward: bool) -> tuple[int, dict[str, int]]:
    """One profiled step (after a first one) of the GPT on (pp, dp) = (2, 2) under FSDP: this
    rank's units and how many all-gathers and reduce-scatters FSDP2 ran, per kind.
    Gathered once per step, even with every micro-batch recomputed; resharded after each
    forward (without recomputation, whose forward would gather a third time), twice per
    micro-batch."""
    from torch.profiler import ProfilerActivity, profile

    from pipeline import Distributed, Pipe

    torch.set_num_threads(1)
    mesh = mesh_of((2, 2))
    x, y = replica_batch(mesh)
    pipe = Pipe(mesh_gpt(), CHUNKS, balance=BALANCES[2], schedule="1f1b",
                checkpoint="never" if reshard_after_forward else "always",
                loss_fn=zoo.gpt_loss(),
                distributed=Distributed.from_mesh(
                    mesh, data_parallel="fsdp", reshard_after_forward=reshard_after_forward),
                timeout=30.0)
    pipe.step(x, y)
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        pipe.step(x, y)
    # The profiler's raw events: building its FunctionEvents (profiled.events()) from a
    # step's ~10,000 events took 3-5 s a rank.
    names = [event.name() for event in profiled.profiler.kineto_results.events()]
    counted = {
        "all_gather": sum(1 for name in names if name == "FSDP::all_gather"),
        "reduce_scatter": sum(1 for name in names if name.startswith("FSDP::post_backward_reduce")),
    }
    units = sharded_units(pipe)
    pipe.close()
    return units, counted


def state_bytes(rank: int, world: int) -> dict[str, int]:
    """Bytes of parameters, gradients and Adam state a rank holds after a step of a one-stage
    pipeline over 4 replicas, replicated and under FSDP."""
    from pipeline import Distributed, Pipe

    torch.set_num_threads(1)
    mesh = mesh_of((1, 4))
    torch.manual_seed(0)
    layers = [module for _ in range(4) for module in (nn.Linear(32, 32), nn.ReLU())]
    model = nn.Sequential(*layers).to(torch.float64)
    x = torch.randn(8, 32, dtype=torch.float64)
    held = {}
    for data_parallel in ("replicate", "fsdp"):
        pipe = Pipe(copy.deepcopy(model), 2, loss_fn=nn.MSELoss(),
                    distributed=Distributed.from_mesh(mesh, data_parallel=data_parallel))
        optimizer = torch.optim.Adam(pipe.parameters(), lr=0.01)
        pipe.step(x, x)
        optimizer.step()
        tensors = [t for p in pipe.parameters() for t in (p, p.grad)
                   if t is not None]
        tensors += [v for state in optimizer.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor)]
        held[data_parallel] = sum(_local(t).nbytes for t in tensors)
        pipe.close()
    return held


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def habits(rank: int, world: int, shape: Sequence[int] = (2, 2)) -> dict[str, float]:
    """What users do with a sharded GPT on ``shape`` (pp, dp[, tp]) under FSDP, each against
    the unpipelined model on the union of the replicas' batches (largest differences):

    - ``accumulated``: two steps without ``zero_grad``: the sum of both batches' gradients.
    - ``norm`` / ``clipped``: ``clip_grad_norm_`` after them: the plain model's total norm
      and its clipped gradients.
    - ``inference``: ``pipe(x)`` on the last stage: the plain model's output; and
      ``gathered_after`` counts the parameters still gathered afterwards (none).
    - ``held``: the share of its stage's parameter elements this rank holds.
    """
    from pipeline import Distributed, Pipe

    torch.set_num_threads(1)
    mesh = mesh_of(shape)
    model = mesh_gpt()
    plain = copy.deepcopy(model)
    batches = [zoo.gpt_batch(rows=2 * zoo.GPT_ROWS, seed=seed) for seed in (1, 2)]
    for x, y in batches:
        zoo.gpt_loss()(plain(x), y).backward()
    accumulated = {key: p.grad.clone() for key, p in zoo.per_layer_parameters(plain).items()}
    norm = float(nn.utils.clip_grad_norm_(plain.parameters(), 0.5))
    clipped = zoo.per_layer_grads(plain)

    pipe = Pipe(model, CHUNKS, balance=BALANCES[shape[0]], loss_fn=zoo.gpt_loss(),
                distributed=Distributed.from_mesh(mesh, data_parallel="fsdp",
                                                  tensor_parallel=plan_for(shape)),
                timeout=30.0)
    coordinate = mesh.get_local_rank("dp")
    for x, y in batches:
        pipe.step(x[coordinate * zoo.GPT_ROWS:(coordinate + 1) * zoo.GPT_ROWS],
                  y[coordinate * zoo.GPT_ROWS:(coordinate + 1) * zoo.GPT_ROWS])
    found: dict[str, float] = {"accumulated": worst(full_grads(model), accumulated)}
    found["norm"] = abs(float(pipe.clip_grad_norm_(0.5)) - norm)
    found["clipped"] = worst(full_grads(model), clipped)
    x = batches[0][0]
    with torch.no_grad():
        output = pipe(x)
        last = pipe.schedule.placement[-1] == mesh.get_local_rank("pp")
        found["inference"] = zoo.difference(output, plain(x)) if last else 0.0
    found["gathered_after"] = sum(1 for p in pipe.parameters() if not isinstance(p, DTensor))
    full = sum(_full(p).numel() for p in pipe.parameters())
    found["held"] = sum(_local(p).numel() for p in pipe.parameters()) / full
    from pipeline import gather_state_dict

    gathered = gather_state_dict(pipe)  # every rank calls: shards are gathered whole
    if gathered is not None:
        initial = mesh_gpt().state_dict()  # no optimizer step: still the initial weights
        found["gathered_state"] = max(zoo.difference(value, initial[key])
                                      for key, value in gathered.items())
        found["gathered_keys"] = float(sorted(gathered) == sorted(initial))
    pipe.close()
    return found


def refusals(rank: int, world: int) -> list[str]:
    """What the Pipe says to mesh options it cannot honour."""
    from pipeline import Distributed, Pipe

    said = []
    for shape, options in (((2, 2), {"data_parallel": "zero"}),
                           ((2, 2), {"data_parallel": "replicate", "reshard_after_forward": True}),
                           ((2, 1, 2), {}),
                           ((2, 2), {"tensor_parallel": tensor_parallel_plan})):
        try:
            Pipe(mesh_gpt(), CHUNKS, loss_fn=zoo.gpt_loss(),
                 distributed=Distributed.from_mesh(mesh_of(shape), **options))
            said.append("accepted")
        except ValueError as error:
            said.append(str(error))
    return said


# -- resuming a sharded checkpoint on other layouts ------------------------------------------

STEPS_BEFORE_SAVE = 3
STEPS_AFTER_LOAD = 3
REPLICAS_THAT_SAVE = 2  # the checkpoint is written on (pp, dp) = (2, 2)


def step_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The union batch of training step ``step`` (every layout trains on the same one)."""
    return zoo.gpt_batch(rows=zoo.GPT_ROWS * REPLICAS_THAT_SAVE, seed=100 + step)


def adam(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(parameters, lr=0.01)


def reference_parameters(steps: int) -> dict[str, torch.Tensor]:
    """The unpipelined GPT after ``steps`` uninterrupted Adam steps on the union batches."""
    model = mesh_gpt()
    optimizer = adam(model.parameters())
    for step in range(steps):
        x, y = step_batch(step)
        optimizer.zero_grad()
        zoo.gpt_loss()(model(x), y).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}


def held_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters by model name, sharded ones whole (replicas call alike)."""
    return {name: _full(p).detach().clone()
            for name, p in model.named_parameters(remove_duplicate=False) if not p.is_meta}


def train_mesh_pipe(pipe: Any, optimizer: torch.optim.Optimizer, mesh: DeviceMesh,
                    steps: range) -> None:
    """Each replica trains on its rows of each step's union batch."""
    names = mesh.mesh_dim_names or ()
    replicas = mesh["dp"].size() if "dp" in names else 1
    coordinate = mesh.get_local_rank("dp") if replicas > 1 else 0
    for step in steps:
        x, y = step_batch(step)
        rows = x.shape[0] // replicas
        part = slice(coordinate * rows, (coordinate + 1) * rows)
        optimizer.zero_grad()
        pipe.step(x[part], y[part])
        optimizer.step()


def sharded_save(rank: int, world: int, directory: str) -> tuple[int, int]:
    """Train the GPT 3 steps on (pp, dp) = (2, 2) under FSDP with Adam and save; how many
    parameters this rank holds sharded, of how many."""
    from pipeline import Distributed, Pipe, save_checkpoint

    torch.set_num_threads(1)
    mesh = mesh_of((2, REPLICAS_THAT_SAVE))
    pipe = Pipe(mesh_gpt(), CHUNKS, balance=BALANCES[2], loss_fn=zoo.gpt_loss(),
                distributed=Distributed.from_mesh(mesh, data_parallel="fsdp"), timeout=30.0)
    optimizer = adam(pipe.parameters())
    train_mesh_pipe(pipe, optimizer, mesh, range(STEPS_BEFORE_SAVE))
    save_checkpoint(pipe, optimizer, directory, STEPS_BEFORE_SAVE)
    held = list(pipe.parameters())
    pipe.close()
    return sum(1 for p in held if isinstance(p, DTensor)), len(held)


def sharded_resumes(rank: int, world: int, directory: str,
                    layouts: Sequence[tuple[Sequence[int], str]]) -> list[tuple[int, float, int]]:
    """``sharded_resume`` on each (shape, data parallelism) in turn."""
    return [sharded_resume(directory, shape, data_parallel) for shape, data_parallel in layouts]


def sharded_resume(directory: str, shape: Sequence[int], data_parallel: str
                   ) -> tuple[int, float, int]:
    """Load the checkpoint on ``shape``, train 3 more steps: the saved step, the largest
    difference from 6 uninterrupted plain steps, and the parameters compared."""
    from pipeline import Distributed, Pipe, load_checkpoint

    torch.set_num_threads(1)
    mesh = mesh_of(shape)
    pipe = Pipe(mesh_gpt(seed=99), CHUNKS, balance=BALANCES[shape[0]],
                loss_fn=zoo.gpt_loss(),
                distributed=Distributed.from_mesh(mesh, data_parallel=data_parallel,
                                                  tensor_parallel=plan_for(shape)),
                timeout=30.0)
    optimizer = adam(pipe.parameters())
    step = load_checkpoint(pipe, optimizer, directory)
    train_mesh_pipe(pipe, optimizer, mesh, range(step, step + STEPS_AFTER_LOAD))
    found = held_parameters(pipe.model)
    expected = reference_parameters(STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD)
    pipe.close()
    return step, max(zoo.difference(found[k], expected[k]) for k in found), len(found)


def groups_fsdp(rank: int, world: int) -> tuple[float, float, int]:
    """FSDP with the groups of ``make_groups`` (no mesh given to the Pipe): the GPT's loss and
    gradient errors against the unpipelined model on the union batch, and the parameters
    this rank holds sharded."""
    from pipeline import Distributed, Pipe, make_groups

    torch.set_num_threads(1)
    pipeline_group, data_group = make_groups(pipeline_size=2, data_parallel_size=2)
    replica = rank // 2  # make_groups' layout: rank = replica * pipeline_size + stage
    x, y = union_batch_of(2)
    rows = x.shape[0] // 2
    model = mesh_gpt()
    expected_loss, expected = zoo.reference_grads(model, x, y, zoo.gpt_loss())
    pipe = Pipe(model, CHUNKS, balance=BALANCES[2], loss_fn=zoo.gpt_loss(),
                distributed=Distributed(pipeline_group, data_group=data_group,
                                        data_parallel="fsdp"),
                timeout=30.0)
    part = slice(replica * rows, (replica + 1) * rows)
    loss = float(pipe.step(x[part], y[part]))
    error = worst(full_grads(model), expected)
    sharded = sum(1 for p in pipe.parameters() if isinstance(p, DTensor))
    pipe.close()
    return abs(loss - expected_loss), error, sharded


def regression_batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` inputs and targets of width 6 (float64), the same on every rank."""
    generator = torch.Generator().manual_seed(5)
    return (torch.randn(rows, 6, generator=generator, dtype=torch.float64),
            torch.randn(rows, 6, generator=generator, dtype=torch.float64))


def plain_grads(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor
                ) -> dict[str, torch.Tensor]:
    """The unpipelined model's per-layer gradients of the MSE loss on (x, y)."""
    nn.MSELoss()(model(x), y).backward()
    return zoo.per_layer_grads(model)


def shared_block_model() -> nn.Sequential:
    """One block instance at positions 1, 2 (stage 0) and 4 (stage 1), ALBERT style, and a
    frozen first layer."""
    torch.manual_seed(3)
    block = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
    model = nn.Sequential(nn.Linear(6, 6), block, block, nn.Linear(6, 6), block,
                          nn.Linear(6, 6)).to(torch.float64)
    model[0].requires_grad_(False)
    return model


def shared_blocks(rank: int, world: int, schedules: Sequence[str]) -> list[float]:
    """Per schedule, the largest gradient difference from the plain model on the union
    batch, for ``shared_block_model`` under FSDP on (pp, dp) = (2, 2)."""
    from pipeline import Distributed, Pipe

    torch.set_num_threads(1)
    mesh = mesh_of((2, 2))
    x, y = regression_batch(16)
    expected = plain_grads(shared_block_model(), x, y)
    part = slice(mesh.get_local_rank("dp") * 8, (mesh.get_local_rank("dp") + 1) * 8)
    found = []
    for schedule in schedules:
        model = shared_block_model()
        pipe = Pipe(model, CHUNKS, balance=[3, 3] if schedule != "zb-v" else [2, 1, 1, 2],
                    schedule=schedule, loss_fn=nn.MSELoss(),
                    distributed=Distributed.from_mesh(mesh, data_parallel="fsdp"), timeout=30.0)
        pipe.step(x[part], y[part])
        grads = {key: g for key, g in full_grads(model).items() if not key.startswith("0.")}
        frozen = [p.grad for p in model[0].parameters() if not p.is_meta]
        found.append(worst(grads, expected) if all(g is None for g in frozen) else float("inf"))
        pipe.close()
    return found


def sharded_crossing(rank: int, world: int, schedules: Sequence[str]) -> list[float]:
    """A stage whose last layer returns a DTensor sharded over tp (a Colwise Linear with
    ``use_local_output=False``) feeding a Rowwise Linear on the next stage, on (pp, dp, tp)
    = (2, 1, 2): per schedule, the largest gradient difference from the plain model."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    from pipeline import Distributed, Pipe

    torch.set_num_threads(1)
    mesh = mesh_of((2, 1, 2))

    def build() -> nn.Sequential:
        torch.manual_seed(7)
        return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 8), nn.Linear(8, 6),
                             nn.Tanh(), nn.Linear(6, 6)).to(torch.float64)

    def plan(layer: nn.Module, tp_mesh: DeviceMesh) -> None:
        if layer is model[2]:
            parallelize_module(layer, tp_mesh, ColwiseParallel(use_local_output=False))
        elif layer is model[3]:
            parallelize_module(layer, tp_mesh, RowwiseParallel())

    x, y = regression_batch(8)
    expected = plain_grads(build(), x, y)
    found = []
    for schedule in schedules:
        model = build()
        pipe = Pipe(model, CHUNKS, balance=[3, 3], schedule=schedule, loss_fn=nn.MSELoss(),
                    distributed=Distributed.from_mesh(mesh, tensor_parallel=plan),
                    timeout=30.0)
        pipe.step(x, y)
        found.append(worst(full_grads(model), expected))
        pipe.close()
    return found


def auto_plan(rank: int, world: int) -> tuple[tuple[Any, ...], float, float]:
    """``chunks="auto", schedule="auto"`` with FSDP on (pp, dp) = (2, 2), the sample on rank 0
    only: the plan every rank runs (schedule, micro-batches, balance, checkpoint), and its
    loss and gradient errors against the plain model on the union batch."""
    from pipeline import Distributed, Pipe, Sample

    torch.set_num_threads(1)
    mesh = mesh_of((2, 2))
    x, y = replica_batch(mesh)
    model = mesh_gpt()
    expected_loss, expected = zoo.reference_grads(model, *union_batch(mesh), zoo.gpt_loss())
    pipe = Pipe(model, "auto", schedule="auto", loss_fn=zoo.gpt_loss(),
                distributed=Distributed.from_mesh(mesh, data_parallel="fsdp"),
                sample=Sample(x, y) if rank == 0 else None, timeout=60.0)
    plan = pipe.plan
    picked = (plan.schedule, plan.microbatches, tuple(plan.balance), plan.checkpoint)
    loss = float(pipe.step(x, y))
    error = worst(full_grads(model), expected)
    pipe.close()
    return picked, abs(loss - expected_loss), error
