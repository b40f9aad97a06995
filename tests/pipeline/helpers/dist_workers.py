"""Functions that run inside spawned gloo ranks for the distributed tests (importable by name)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from models import tied_head

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")
MODES = ("always", "except_last", "never")


def deep_mlp(width: int = 6, blocks: int = 8) -> nn.Sequential:
    """A float64 MLP of ``2 * blocks`` layers, the same on every rank."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers).double()


def batch(rows: int = 13, width: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator, dtype=torch.float64)
    y = torch.randn(rows, width, generator=generator, dtype=torch.float64)
    return x, y


def reference_grads(x: Any, y: Any, model: nn.Sequential | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    model = model if model is not None else deep_mlp()
    loss = nn.MSELoss()(model(x), y)
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def grad_error(model: nn.Sequential, reference: dict[str, torch.Tensor]) -> tuple[float, int]:
    """Largest difference over this rank's gradients, and how many tensors were compared."""
    worst, compared = 0.0, 0
    for name, parameter in model.named_parameters():
        if parameter.is_meta:
            continue
        if parameter.grad is None:
            return float("inf"), compared
        worst = max(worst, (parameter.grad - reference[name]).abs().max().item())
        compared += 1
    return worst, compared


def equivalence(rank: int, world: int, schedules: tuple[str, ...], chunk_counts: tuple[int, ...],
                transport: str = "auto", modes: tuple[str, ...] = MODES,
                timeout: float = 60.0) -> list[tuple[Any, ...]]:
    """Every (schedule, mode, chunks): loss and local-gradient errors against the plain model."""
    from pipeline import Distributed, Pipe

    x, y = batch()
    reference_loss, reference = reference_grads(x, y)
    rows = []
    for schedule in schedules:
        for mode in modes:
            for chunks in chunk_counts:
                model = deep_mlp()
                pipe = Pipe(model, chunks=chunks, schedule=schedule, checkpoint=mode,
                            loss_fn=nn.MSELoss(),
                            distributed=Distributed(dist.group.WORLD, transport=transport),
                            timeout=timeout)
                first = pipe.schedule.placement[0] == rank
                last = pipe.schedule.placement[-1] == rank
                loss = pipe.step(x if first else None, y if last else None)
                error, compared = grad_error(model, reference)
                rows.append((schedule, mode, chunks, abs(loss.item() - reference_loss), error,
                             compared))
                pipe.close()
    return rows


def timeline_on_one_clock(rank: int, world: int) -> Any:
    from pipeline import Pipe
    from schedules import transfers

    x, y = batch(rows=16)
    pipe = Pipe(deep_mlp(), chunks=4, schedule="1f1b", loss_fn=nn.MSELoss(), group=dist.group.WORLD)
    pipe.step(x, y)
    pipe.step(x, y)
    timeline = pipe.timeline
    if rank != 0:
        return timeline is None
    orders_match = all(
        timeline.stage_order(s) == pipe.schedule.order[s] for s in range(world)
    )
    ends = {(e.stage, e.action): e for e in timeline.events}
    slack = min(
        ends[(t.destination, t.consumer)].start - ends[(t.source, t.producer)].end
        for t in transfers(pipe.schedule)
    )
    return orders_match, slack, len(timeline.events), timeline.bubble_fraction


class RaiseAt(nn.Module):
    """Raises on the given micro-batch count of forwards (a layer that fails mid-step)."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("injected failure")
        return x


def failing_rank(rank: int, world: int, failing: int, abrupt: bool) -> Any:
    """Rank ``failing`` raises (or dies abruptly) in its third forward; report what others see.
    On a fresh group: the failed step leaves it unusable, the world group as it was."""
    from pipeline import Pipe

    x, y = batch(rows=16)
    model = deep_mlp(blocks=world)
    layers = list(model)
    position = 2 * failing + 1  # inside the failing rank's share under a uniform balance
    layers.insert(position, RaiseAt(after=2) if not abrupt else _Exit(after=2, rank=failing))
    layers.pop(position + 1)  # keep the layer count a multiple of the world size
    pipe = Pipe(nn.Sequential(*layers), chunks=8, schedule="1f1b", loss_fn=nn.MSELoss(),
                group=dist.new_group(list(range(world))), timeout=4.0)
    started = time.monotonic()
    try:
        pipe.step(x if rank == 0 else None, y if rank == world - 1 else None)
    except Exception as error:
        return "raised", type(error).__name__, str(error), time.monotonic() - started
    return "finished", "", "", time.monotonic() - started


class _Exit(nn.Module):
    def __init__(self, after: int, rank: int) -> None:
        super().__init__()
        self.after, self.rank, self.calls = after, rank, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > self.after:
            os._exit(3)
        return x


def disagreement(rank: int, world: int) -> Any:
    from pipeline import Pipe

    balance = [4, 12] if rank == 1 else [8, 8]
    try:
        Pipe(deep_mlp(), chunks=4, balance=balance, loss_fn=nn.MSELoss(), group=dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return "constructed"


def wrong_stage_count(rank: int, world: int) -> Any:
    from pipeline import Pipe
    from schedules import one_f_one_b

    messages = []
    for arguments in ({"balance": [4, 4, 4, 4]}, {"schedule": one_f_one_b(3, 4)}):
        try:
            Pipe(deep_mlp(), chunks=4, loss_fn=nn.MSELoss(), group=dist.group.WORLD, **arguments)
            messages.append("constructed")
        except ValueError as error:
            messages.append(str(error))
    return messages


def state_and_inference(rank: int, world: int, path: str) -> Any:
    """Gather the trained pipe's state on rank 0, save it, and compare plain vs pipelined outputs."""
    from pipeline import Pipe, gather_state_dict, save_state_dict

    x, y = batch()
    model = deep_mlp()
    model.insert(3, nn.Dropout(0.5))  # inference must respect eval()
    pipe = Pipe(model, chunks=3, loss_fn=nn.MSELoss(), group=dist.group.WORLD)
    pipe.step(x, y)
    with torch.no_grad():
        for parameter in pipe.parameters():
            parameter.sub_(0.1 * parameter.grad)
    local_keys = sorted(pipe.state_dict())
    state = gather_state_dict(pipe)
    if rank == 0:
        save_state_dict(state, path)
    pipe.eval()
    output = pipe(x)
    pipe.train()
    training_output = pipe(x)
    dist.barrier()
    if rank != world - 1:
        return local_keys, output is None
    plain = deep_mlp()
    plain.insert(3, nn.Dropout(0.5))
    plain.load_state_dict(torch.load(path))
    plain.eval()
    with torch.no_grad():
        expected = plain(x)
    return (local_keys, (output - expected).abs().max().item(),
            (training_output - expected).abs().max().item())


def clipping(rank: int, world: int, max_norm: float) -> Any:
    from pipeline import Pipe

    x, y = batch()
    model = deep_mlp()
    pipe = Pipe(model, chunks=4, loss_fn=nn.MSELoss(), group=dist.group.WORLD)
    pipe.step(x, y)
    norm = pipe.clip_grad_norm_(max_norm)
    plain = deep_mlp()
    nn.MSELoss()(plain(x), y).backward()
    expected_norm = nn.utils.clip_grad_norm_(plain.parameters(), max_norm)
    reference = {name: p.grad for name, p in plain.named_parameters()}
    error, compared = grad_error(model, reference)
    return abs(norm.item() - expected_norm.item()), error, compared


def data_parallel(rank: int, world: int) -> Any:
    """2 stages x 2 replicas: gradients equal the plain model's on the union of the batches
    (the groups given as ``Distributed``; given both ways, the Pipe refuses)."""
    from pipeline import Distributed, Pipe, make_groups

    pipeline_group, data_group = make_groups(pipeline_size=2, data_parallel_size=2)
    replica = rank // 2
    x, y = batch(rows=12, seed=10 + replica)
    model = deep_mlp()
    distributed = Distributed(pipeline_group, data_group=data_group)
    try:
        Pipe(model, chunks=3, loss_fn=nn.MSELoss(), distributed=distributed, group=pipeline_group)
        refused = "accepted both"
    except ValueError as error:
        refused = str(error)
    pipe = Pipe(model, chunks=3, loss_fn=nn.MSELoss(), distributed=distributed)
    return (*_against_both_replicas(pipe, x, y, seed=10), refused)


def _against_both_replicas(pipe: Any, x: torch.Tensor, y: torch.Tensor, seed: int
                           ) -> tuple[float, float, int]:
    """One step of this replica's batch; its loss and gradients against the plain model on
    both replicas' batches (seeds ``seed`` and ``seed + 1``): loss error, gradient error,
    parameters compared."""
    loss = pipe.step(x, y)
    union_x = torch.cat([batch(rows=12, seed=seed + r)[0] for r in range(2)])
    union_y = torch.cat([batch(rows=12, seed=seed + r)[1] for r in range(2)])
    reference_loss, reference = reference_grads(union_x, union_y)
    error, compared = grad_error(pipe.model, reference)
    return abs(loss.item() - reference_loss), error, compared


class SequenceModel(nn.Module):
    """Mixes along the sequence (a mean over it) so a wrong shape cannot go unnoticed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x.mean(dim=1, keepdim=True)


def sequence_model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Linear(4, 4), SequenceModel(), nn.Tanh(), nn.Linear(4, 4), SequenceModel(), nn.Linear(4, 4)
    ).double()


def variable_lengths(rank: int, world: int) -> Any:
    """Pre-split micro-batches of different sequence lengths, within a step and across steps."""
    from pipeline import Pipe

    generator = torch.Generator().manual_seed(5)

    def micro(rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(rows, length, 4, generator=generator, dtype=torch.float64),
                torch.randn(rows, length, 4, generator=generator, dtype=torch.float64))

    steps = [
        [micro(3, 5), micro(3, 7), micro(2, 6)],
        [micro(3, 5), micro(3, 7), micro(2, 6)],  # same shapes: buffers are reused
        [micro(4, 9), micro(2, 3), micro(2, 9)],
    ]
    model = sequence_model()
    pipe = Pipe(model, chunks=3, loss_fn=nn.MSELoss(), group=dist.group.WORLD, schedule="1f1b")
    allocations = []
    losses = []
    for step in steps:
        xs, ys = [m[0] for m in step], [m[1] for m in step]
        losses.append(pipe.step(xs, ys).item())
        allocations.append(pipe._runner.transport.pool.allocations)
    outputs = pipe([m[0] for m in steps[2]])
    plain = sequence_model()
    expected_losses = []
    for step in steps:
        # A mean loss over micro-batches of different lengths: every element counts once.
        total = sum(m[1].numel() for m in step)
        loss = sum(nn.MSELoss(reduction="sum")(plain(m[0]), m[1]) / total for m in step)
        loss.backward()
        expected_losses.append(loss.item())
    reference = {name: p.grad for name, p in plain.named_parameters()}
    error, compared = grad_error(model, reference)
    output_error = None
    if outputs is not None:
        with torch.no_grad():
            output_error = max((o - plain(m[0])).abs().max().item() for o, m in zip(outputs, steps[2]))
    loss_error = max(abs(a - b) for a, b in zip(losses, expected_losses))
    return loss_error, error, compared, allocations, output_error


def meta_init(rank: int, world: int) -> Any:
    """A model built on the meta device: only this rank's layers are materialised."""
    from pipeline import Distributed, Pipe

    def init(layer: nn.Module) -> None:
        for name, parameter in layer.named_parameters():
            with torch.no_grad():
                parameter.copy_(torch.linspace(-0.5, 0.5, parameter.numel(), dtype=parameter.dtype)
                                .reshape(parameter.shape))

    with torch.device("meta"):
        model = deep_mlp()
    pipe = Pipe(model, chunks=2, loss_fn=nn.MSELoss(),
                distributed=Distributed(dist.group.WORLD, init_fn=init))
    x, y = batch()
    pipe.step(x, y)
    materialised = sorted({name.split(".")[0] for name, p in model.named_parameters() if not p.is_meta})
    plain = deep_mlp()
    for layer in plain:
        init(layer)
    _, reference = reference_grads(x, y, plain)
    error, compared = grad_error(model, reference)
    return materialised, error, compared


def repeated_steps(rank: int, world: int, schedules: tuple[str, ...]) -> list[tuple[str, float]]:
    """Several steps of same-shaped micro-batches (the transport's predicted path), then a
    differently shaped batch (the reshaped path) and back: every step's gradients exact."""
    from pipeline import Pipe

    results = []
    batches = [batch(), batch(), batch(), batch(rows=10, seed=2), batch(), batch()]
    for schedule in schedules:
        model = deep_mlp()
        pipe = Pipe(model, chunks=4, schedule=schedule, checkpoint="never",
                    loss_fn=nn.MSELoss(), group=dist.group.WORLD)
        worst = 0.0
        for x, y in batches:
            pipe.zero_grad()
            pipe.step(x, y)
            _, reference = reference_grads(x, y)
            error, compared = grad_error(model, reference)
            worst = max(worst, error if compared else float("inf"))
        results.append((schedule, worst))
    return results


def measured_memory(rank: int, world: int) -> tuple[str, list[float], list[float]]:
    """``pipe.memory`` on ranks: refused before a measured step, then this rank's stage's
    micro-batches held (1F1B then GPipe), against the simulator's figure for that stage."""
    from pipeline import Pipe
    from schedules import simulate

    x, y = batch()
    measured, simulated = [], []
    refused = ""
    for schedule in ("1f1b", "gpipe"):
        pipe = Pipe(deep_mlp(), chunks=4, schedule=schedule, checkpoint="never",
                    loss_fn=nn.MSELoss(), group=dist.group.WORLD)
        pipe.step(x, y)
        try:
            pipe.memory
        except ValueError as error:
            refused = str(error)
        with pipe.measure_memory():
            pipe.step(x, y)
        (report,) = pipe.memory
        measured.append(report.peak_activations)
        simulated.append(simulate(pipe.schedule).peak_activations[rank])
        pipe.close()
    return refused, measured, simulated


def naive_plan_under_nccl_rules(rank: int, world: int) -> Any:
    """The posting order the runtime used before comm plans: it must hang under NCCL's rules
    (and the timeout must turn the hang into a PeerError on every rank)."""
    from pipeline import Distributed, PeerError, Pipe
    from pipeline.runtime.rank_share import rank_share

    x, y = batch()
    pipe = Pipe(deep_mlp(), chunks=4, schedule="1f1b", loss_fn=nn.MSELoss(),
                distributed=Distributed(dist.group.WORLD, transport="ordered"), timeout=3.0)
    runner = pipe._runner
    runner.share = rank_share(pipe.schedule, rank, strategy="naive", prove=False)
    started = time.monotonic()
    try:
        pipe.step(x if rank == 0 else None, y if rank == world - 1 else None)
    except PeerError as error:
        return "PeerError", time.monotonic() - started, str(error)
    return "finished", time.monotonic() - started, ""


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a rank that goes silent after its peers' last sends."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        time.sleep(ctx.seconds)
        return grad, None


class SilentLayer(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if torch.is_grad_enabled() and self.calls == 4 and self.seconds:  # the last micro-batch
            return _SleepInBackward.apply(x, self.seconds)
        return x


def silent_peer(rank: int, world: int, seconds: float, timeout: float) -> Any:
    """Rank 0 goes silent in its last backward of the first step; rank 1 has by then all it
    needs (the loss came with the backward messages) and finishes that step. Each rank's
    steps, three in turn: (outcome, seconds, error text). On a fresh group, which the steps
    leave unusable."""
    from pipeline import PeerError, Pipe

    x, y = batch()
    layers = list(deep_mlp())
    model = nn.Sequential(layers[0], SilentLayer(seconds if rank == 0 else 0.0), *layers[1:])
    pipe = Pipe(model, chunks=4, schedule="gpipe", checkpoint="never", loss_fn=nn.MSELoss(),
                group=dist.new_group(list(range(world))), timeout=timeout)
    outcomes = []
    for _ in range(3):
        started = time.monotonic()
        try:
            pipe.step(x if rank == 0 else None, y if rank == world - 1 else None)
        except PeerError as error:
            outcomes.append(("PeerError", time.monotonic() - started, str(error)))
        else:
            outcomes.append(("finished", time.monotonic() - started, ""))
    return outcomes


def timeline_after_close(rank: int, world: int) -> Any:
    """Two steps, then every rank closes and leaves at once; rank 0 reads the last timeline."""
    from pipeline import Pipe

    x, y = batch()
    pipe = Pipe(deep_mlp(), chunks=4, schedule="1f1b", loss_fn=nn.MSELoss(),
                group=dist.group.WORLD)
    losses = [pipe.step(x if rank == 0 else None, y if rank == world - 1 else None).item()
              for _ in range(2)]
    pipe.close()
    timeline = pipe.timeline
    if timeline is None:
        return losses, None
    return losses, sorted({event.stage for event in timeline.events}), len(timeline.events)


def structured_payloads(rank: int, world: int, transport: str) -> Any:
    """Dicts, lists, None, ints, bool and int tensors, complex tensors across ranks; x.grad."""
    from models import structured_model

    from pipeline import Distributed, Pipe

    torch.manual_seed(0)
    model = structured_model()
    reference = structured_model()
    reference.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(8, 6, dtype=torch.float64, generator=generator)
    y = torch.randn(8, 2, dtype=torch.float64, generator=generator)
    x_reference = x.clone().requires_grad_()
    nn.MSELoss()(reference(x_reference), y).backward()
    x.requires_grad_()
    balance = [1, 2, 2, 1] if world == 4 else [1, 5]
    pipe = Pipe(model, chunks=4, balance=balance, schedule="1f1b", loss_fn=nn.MSELoss(),
                distributed=Distributed(dist.group.WORLD, transport=transport))
    loss = pipe.step(x if rank == 0 else None, y if rank == world - 1 else None)
    expected = {name: p.grad for name, p in reference.named_parameters()}
    error, compared = grad_error(model, expected)
    input_error = (x.grad - x_reference.grad).abs().max().item() if rank == 0 else 0.0
    pipe.close()
    return error, compared, input_error, loss.item()


def tied_model() -> nn.Sequential:
    torch.manual_seed(0)
    return tied_head(6)


def tied_weights(rank: int, world: int) -> Any:
    """A head tied to the embedding on another rank: full gradient on both, clipping and the
    gathered state count it once, and the state loads into the plain model."""
    from pipeline import Pipe, SummedLoss, gather_state_dict

    def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten(), ignore_index=-100)

    generator = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 11, (8, 5), generator=generator)
    targets = torch.randint(0, 11, (8, 5), generator=generator)
    targets[2:4] = -100
    reference = tied_model()
    lm_loss(reference(tokens), targets).backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1).item()
    def summed(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten(), ignore_index=-100,
                                           reduction="sum")

    model = tied_model()
    pipe = Pipe(model, chunks=4, balance=[2, 3], schedule="zb-h1",
                loss_fn=SummedLoss(summed, count=lambda target: (target != -100).sum()),
                group=dist.group.WORLD)
    pipe.step(tokens if rank == 0 else None, targets if rank == 1 else None)
    tied = model[0].weight if rank == 0 else model[4].weight
    norm = pipe.clip_grad_norm_(0.1).item()
    grad_error_tied = (tied.grad - reference[0].weight.grad).abs().max().item()
    state = gather_state_dict(pipe)
    loads = None
    if rank == 0:
        plain = tied_model()
        plain.load_state_dict(state)
        loads = sorted(k for k in state if k.endswith("weight"))
    pipe.close()
    return grad_error_tied, abs(norm - expected_norm), loads


def autocast_step(rank: int, world: int) -> Any:
    """bf16 autocast around step and pipe(x) reaches the stage on every rank, the recomputed
    forward included; gradients match the unpipelined model under the same autocast."""
    from pipeline import Pipe

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))
    reference = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))
    reference.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out.float(), target)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_fn(reference(x), y).backward()
    pipe = Pipe(model, chunks=2, balance=[2, 2], checkpoint="always", loss_fn=loss_fn,
                group=dist.group.WORLD)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe.step(x if rank == 0 else None, y if rank == 1 else None)
        with torch.no_grad():
            out = pipe(x if rank == 0 else None)
    expected = {name: p.grad for name, p in reference.named_parameters()}
    worst = 0.0
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            worst = max(worst, ((parameter.grad - expected[name]).abs().max()
                                / expected[name].abs().max()).item())
    pipe.close()
    return (out.dtype if out is not None else None), worst


def scaler_overflow(rank: int, world: int) -> Any:
    """Gradients overflow on rank 0 only; with the Pipe sharing it, both ranks skip the step."""
    from pipeline import Pipe

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    pipe = Pipe(model, chunks=2, balance=[1, 2], loss_fn=nn.MSELoss(), group=dist.group.WORLD)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
    x, y = torch.randn(4, 16) * 1e25, torch.randn(4, 4)
    pipe.step(x if rank == 0 else None, y if rank == 1 else None, scaler=scaler)
    before = [p.detach().clone() for p in pipe.parameters()]
    scaler.step(optimizer)
    scaler.update()
    unchanged = all(torch.equal(b, p) for b, p in zip(before, pipe.parameters()))
    pipe.close()
    return unchanged, scaler.get_scale()


def auto_plan(rank: int, world: int) -> Any:
    """Rank 0 plans; every rank runs the same pick, with exact gradients."""
    from pipeline import Pipe

    x, y = batch(rows=16)
    _, reference = reference_grads(x, y)
    model = deep_mlp()
    pipe = Pipe(model, chunks="auto", schedule="auto", sample=x if rank == 0 else None,
                loss_fn=nn.MSELoss(), group=dist.group.WORLD)
    placement = pipe.schedule.placement
    pipe.step(x if placement[0] == rank else None, y if placement[-1] == rank else None)
    error, compared = grad_error(model, reference)
    picked = (pipe.plan.schedule, pipe.plan.microbatches, tuple(pipe.plan.balance),
              pipe.plan.checkpoint)
    pipe.close()
    return picked, error, compared


def tied_on_meta(rank: int, world: int) -> str:
    from pipeline import Pipe

    with torch.device("meta"):
        model = tied_model()
    try:
        Pipe(model, chunks=2, balance=[2, 3], loss_fn=nn.MSELoss(), group=dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return "accepted"


def failed_profile_on_rank_zero(rank: int, world: int) -> Any:
    """balance="time": rank 0 profiles for everyone; its failure must reach every rank at once."""
    from pipeline import Pipe

    started = time.monotonic()
    wrong_width = torch.randn(8, 7)  # deep_mlp takes 6 features
    try:
        Pipe(deep_mlp(), chunks=2, balance="time", sample=wrong_width if rank == 0 else None,
             loss_fn=nn.MSELoss(), group=dist.group.WORLD, timeout=20.0)
    except Exception as error:  # noqa: BLE001 - the test reads the type and text
        return type(error).__name__, str(error)[:200], time.monotonic() - started
    return "built", "", time.monotonic() - started


def parameters_after_close(rank: int, world: int) -> tuple[int, int]:
    """Parameter elements this rank's Pipe reports before and after ``close``."""
    from pipeline import Pipe

    pipe = Pipe(deep_mlp(), chunks=2, schedule="1f1b", loss_fn=nn.MSELoss(),
                group=dist.group.WORLD)
    x, y = batch()
    pipe.step(x if rank == 0 else None, y if rank == world - 1 else None)
    before = sum(p.numel() for p in pipe.parameters())
    pipe.close()
    return before, sum(p.numel() for p in pipe.parameters())


def mesh_data_parallel(rank: int, world: int) -> Any:
    """A (pp, dp) = (2, 2) device mesh: the pipeline along pp, replicas along dp, gradients
    equal the plain model's on the union of the replicas' batches."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeline import Pipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    replica = mesh.get_local_rank("dp")
    x, y = batch(rows=12, seed=20 + replica)
    model = deep_mlp()
    pipe = Pipe(model, chunks=3, loss_fn=nn.MSELoss(), mesh=mesh)
    loss_error, error, compared = _against_both_replicas(pipe, x, y, seed=20)
    pipe.close()
    return loss_error, error, compared, pipe.stages


def detection_rows(rank: int, world: int, runs: tuple[tuple[str, str, str], ...]) -> list[Any]:
    """Issue 31 rows 4-6 on ranks: each (case, schedule, mode) of ``detection_cases``."""
    from detection_cases import run_case

    torch.set_num_threads(1)
    results = []
    for case, schedule, mode in runs:
        result = run_case(case, schedule, mode, group=dist.group.WORLD, timeout=60.0)
        # Tensors would cross to the parent as shared memory, gone once the rank exits.
        result["grads"] = {name: grad.tolist() for name, grad in result["grads"].items()}
        results.append(result)
    return results
