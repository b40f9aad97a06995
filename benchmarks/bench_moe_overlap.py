"""Expert parallelism's all-to-alls on a declared link: the step time they expose, and predict's error.

Run from the repository root:

    python benchmarks/bench_moe_overlap.py                 # (pp=2, ep=2), 4 gloo ranks
    python benchmarks/bench_moe_overlap.py --schedules 1f1b,dualpipe-v,dualpipe-v+overlap

A mixture-of-experts language model written by hand (float32, experts with Hugging Face's
interface) trains at ``(pp=2, ep=2)`` under each schedule given (``NAME+overlap``: NAME
with ``schedule_options={"overlap": True}``, its overlapped F&B pairs), its experts
spread over ``ep`` (``expert_parallel=``). Four ranks share two cores here, so compute
is given known costs that take no core: each attention and each experts call sleeps
``--cost`` forward and twice that backward (beside its small real compute), as the zero
bubble benchmarks do. gloo's all-to-all between processes of one host costs next to
nothing, so each token exchange is given a declared link (``Exchange.declared_link``: it
completes no sooner than ``size - 1`` messages of latency + bytes / bandwidth after it was
issued). The layers are cut so that every chunk holds as many MoE layers (embedding and
head beside the first and last): a pair's forward and backward then stop at as many
exchanges, each covering the other's; with more on one side, its surplus exchanges wait
in full once the other has ended. Per schedule, the median step of each launch:

- ``exposed``: the step with the declared link minus the step without it, over the
  all-to-all time declared on the busiest stage (its exchanges' costs, summed): 1.00
  means its every exchange waited in full on the critical path, 0 that the schedule hid
  them all (above 1: the other stages' exchanges lie on the critical path too).
- ``waited``: the time the busiest rank's exchanges were waited for, over the same
  declared time (what its stage's computation did not cover).
- ``hidden``: ``1 - exposed / exposed of the first schedule`` (the unoverlapped baseline,
  DualPipeV's plain timetable): what a schedule hides of what the baseline exposes.
- ``predicted_error``: ``|Pipe.predict() - measured| / measured`` with the declared link
  (predict measures each chunk with its exchanges, as the runtime runs it, and refines
  its compute by the last steps, the declared ones).

The line ``RESULT hidden=<fraction> predicted_error=<fraction>`` gives the last schedule's,
the medians over the launches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]


@torch.library.custom_op("bench_moe::sleep", mutates_args=())
def _sleep(x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
    """``x``, after ``forward_s`` seconds; its backward takes ``backward_s``: a known cost
    that takes no core (ranks share two), one opaque call in the traced graph."""
    time.sleep(forward_s)
    return x.clone()


@_sleep.register_fake
def _(x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
    return torch.empty_like(x)


def _sleep_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.backward_s = inputs[2]


def _sleep_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    time.sleep(ctx.backward_s)
    return grad, None, None


_sleep.register_autograd(_sleep_backward, setup_context=_sleep_setup)


def _model(layers: int, width: int, experts: int, cost: float) -> torch.nn.Module:
    """A mixture-of-experts language model whose attention and experts each cost ``cost``
    seconds forward and twice that backward (sleeps), beside their small real compute."""
    from torch import nn
    from torch.nn import functional as F

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = experts
            self.gate_up_proj = nn.Parameter(torch.randn(experts, 4 * width, width) * 0.05)
            self.down_proj = nn.Parameter(torch.randn(experts, width, 2 * width) * 0.05)

        def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
            hidden = _sleep(hidden, cost, 2 * cost)
            out = torch.zeros_like(hidden)
            for expert in range(self.num_experts):
                token, pick = torch.where(top_k_index == expert)
                if len(token):
                    gate, up = F.linear(hidden[token], self.gate_up_proj[expert]).chunk(2, -1)
                    value = F.linear(F.silu(gate) * up, self.down_proj[expert])
                    out.index_add_(0, token, value * top_k_weights[token, pick, None])
            return out

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.mix = nn.Linear(width, width)
            self.router = nn.Linear(width, experts)
            self.experts = Experts()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + _sleep(self.mix(self.norm(x)), cost, 2 * cost)
            flat = x.reshape(-1, width)
            weights, index = torch.topk(torch.softmax(self.router(flat), -1), 2, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
            return x + self.experts(flat, index, weights).view_as(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, width)
            self.layers = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Linear(width, 64)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(input_ids)
            for block in self.layers:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    return Model()


def _rank(rank: int, world: int, schedules: list[str], options: dict[str, Any]
          ) -> list[dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn import functional as F

    from pipeline import Distributed, Pipe, SummedLoss
    from schedules import Link

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    rows, length = options["rows"], options["length"]
    generator = torch.Generator().manual_seed(1 + mesh.get_local_rank("ep"))
    ids = torch.randint(0, 64, (rows, length), generator=generator)
    batch = {"input_ids": ids}
    loss_fn = SummedLoss(lambda out, labels: F.cross_entropy(out.flatten(0, 1), labels.flatten(),
                                                             reduction="sum"),
                         lambda labels: labels.numel())
    link = Link(latency=options["latency"], bandwidth=options["bandwidth"])
    found = []
    for schedule in schedules:
        model = _model(options["layers"], options["width"], 4, options["cost"])
        name, _, overlap = schedule.partition("+")  # "dualpipe-v+overlap": its F&B pairs
        per_chunk = options["layers"] // 4  # DualPipeV's 4 chunks: the same MoE layers in each,
        balance = [1 + per_chunk, per_chunk, per_chunk, per_chunk + 1]  # so pairs match
        with Pipe(model, chunks=options["chunks"], schedule=name, checkpoint="never",
                  balance=balance,
                  schedule_options={"overlap": True} if overlap else None,
                  sample=batch, loss_fn=loss_fn,
                  distributed=Distributed.from_mesh(mesh, expert_parallel={
                      "layers.*.experts": "ep_dispatch_experts"})) as pipe:
            exchange = pipe.expert_exchange
            assert exchange is not None
            times: dict[str, list[float]] = {"plain": [], "declared": []}
            declared = waited = 0.0
            for _ in range(options["warmup"]):
                pipe.step(batch, ids)
            for kind in ("plain", "declared"):  # the declared last: predict() reads them
                for _ in range(options["steps"]):
                    exchange.declared_link = link if kind == "declared" else None
                    before = exchange.counts.forward_bytes, exchange.counts.backward_bytes, \
                        exchange.counts.forward + exchange.counts.backward, exchange.counts.waited
                    start = time.perf_counter()
                    pipe.step(batch, ids)
                    times[kind].append(time.perf_counter() - start)
                    if kind == "declared":
                        sent = (exchange.counts.forward_bytes - before[0]
                                + exchange.counts.backward_bytes - before[1])
                        calls = exchange.counts.forward + exchange.counts.backward - before[2]
                        declared = (calls * (world // 2 - 1) * link.latency
                                    + sent * (world // 2 - 1) / (world // 2) / link.bandwidth)
                        waited = exchange.counts.waited - before[3]
            exchange.declared_link = link
            predicted = pipe.predict(batch, ids).makespan
            found.append({"schedule": schedule, "plain": statistics.median(times["plain"]),
                          "declared": statistics.median(times["declared"]),
                          "declared_a2a": declared, "waited": waited, "predicted": predicted})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="dualpipe-v,dualpipe-v+overlap",
                        help="the first is the baseline; NAME+overlap runs NAME's pairs")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--cost", type=float, default=8e-3,
                        help="seconds an attention or an experts call sleeps forward (x2 back)")
    parser.add_argument("--latency", type=float, default=6e-3)
    parser.add_argument("--bandwidth", type=float, default=1e8, help="bytes per second")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args()
    from _spawn import run_ranks

    schedules = args.schedules.split(",")
    options = {key: getattr(args, key) for key in ("layers", "width", "rows", "length", "chunks",
                                                   "latency", "bandwidth", "steps", "warmup",
                                                   "cost")}
    runs = [run_ranks(_rank, 4, schedules, options, timeout=900) for _ in range(args.launches)]
    print(f"(pp=2, ep=2), 4 gloo ranks; declared link: {args.latency * 1e3:.2f} ms + bytes / "
          f"{args.bandwidth:.0e} B/s per message; medians over {args.launches} launches")
    print(f"{'schedule':<20}{'step':>9}{'+ link':>9}{'declared a2a':>14}{'waited':>8}"
          f"{'exposed':>9}{'hidden':>8}{'predicted':>11}{'error':>8}")
    baseline = None
    hidden = error = 0.0
    for index, schedule in enumerate(schedules):
        # the ranks' step times agree (one step); the busiest stage's declared time
        rows = [run[0][index] for run in runs]
        plain = statistics.median(row["plain"] for row in rows)
        declared = statistics.median(row["declared"] for row in rows)
        a2a = statistics.median(max(rank[index]["declared_a2a"] for rank in run) for run in runs)
        predicted = statistics.median(row["predicted"] for row in rows)
        waited = statistics.median(max(rank[index]["waited"] for rank in run) for run in runs)
        exposed = (declared - plain) / a2a if a2a else 0.0
        baseline = exposed if baseline is None else baseline
        hidden = 1.0 - exposed / baseline if baseline else 0.0
        error = abs(predicted - declared) / declared
        print(f"{schedule:<20}{plain:>8.3f}s{declared:>8.3f}s{a2a:>13.3f}s{waited / a2a:>8.2f}"
              f"{exposed:>9.2f}{hidden:>8.2f}{predicted:>10.3f}s{error:>8.3f}")
    print(f"RESULT hidden={hidden:.3f} predicted_error={error:.3f}")


if __name__ == "__main__":
    main()
