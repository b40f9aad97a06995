"""Train an MLP with one pipeline stage per process.

Run on CPU (gloo) or GPUs (NCCL), unchanged:

    torchrun --nproc-per-node 2 examples/train_mlp.py --steps 30
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint HOST:29500 examples/train_mlp.py

Rank 0 prints the falling loss, the measured and the predicted bubble, and can
write the measured-vs-predicted timeline (``--plot``) and the measured events
(``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from pipeline import Pipe
from schedules import Timeline


def build_model(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def teacher_batch(rows: int, width: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed nonlinear regression task: eight batches in turn, the same on every rank."""
    generator = torch.Generator().manual_seed(1000 + step % 8)
    x = torch.randn(rows, width, generator=generator)
    direction = torch.linspace(-1.0, 1.0, width)
    y = torch.sin(x @ direction / width**0.5).unsqueeze(1)
    return x, y


def plot_side_by_side(measured: Timeline, predicted: Timeline, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from schedules import plot_timeline

    figure, axes = plt.subplots(2, 1, figsize=(14, 2.2 + 1.1 * measured.stages), sharex=True)
    plot_timeline(measured, ax=axes[0], title="measured")
    plot_timeline(predicted, ax=axes[1], title="pipe.predict (measured compute, calibrated hops)")
    axes[1].set_xlabel("seconds")
    limit = max(measured.makespan, predicted.makespan)
    for axis in axes:
        axis.set_xlim(0, limit)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--checkpoint", default="except_last")
    parser.add_argument("--plot", help="write the measured-vs-predicted timeline PNG here")
    parser.add_argument("--json", help="write the last step's measured events here")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "gloo":
        torch.set_num_threads(1)  # the ranks share this host's cores
    rank = dist.get_rank()
    model = build_model(args.width, args.depth)
    pipe = Pipe(model, chunks=args.chunks, schedule=args.schedule, checkpoint=args.checkpoint,
                loss_fn=nn.MSELoss(), group=dist.group.WORLD)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=args.lr)
    losses: list[float] = []
    makespans: list[float] = []  # rank 0: each step's, seconds
    progress = tqdm(range(args.steps), disable=rank != 0, desc=f"{args.schedule} x{pipe.stages}",
                    unit="step")
    for step in progress:
        x, y = teacher_batch(args.batch, args.width, step)
        loss = pipe.step(x, y)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if pipe.timeline is not None:  # the whole step's, on rank 0
            makespans.append(pipe.timeline.makespan)
        progress.set_postfix(loss=f"{loss.item():.4f}")
    # Every rank: the step as pipe.predict sees it after these steps, each stage's compute
    # from its measured busy time and every hop as calibrated and measured, as a user asks.
    predicted = pipe.predict(*teacher_batch(args.batch, args.width, args.steps - 1),
                             optimizer=optimizer)
    if rank == 0:
        measured = pipe.timeline
        assert measured is not None
        print(f"loss: {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps")
        recent = sorted(makespans[-5:])
        print(f"step: measured {recent[len(recent) // 2] * 1e3:.1f} ms (median of the last "
              f"{len(recent)}), predicted by pipe.predict {predicted.makespan * 1e3:.1f} ms "
              f"(compute and communication); bubble: last step {measured.bubble_fraction:.1%}, "
              f"predicted {predicted.bubble_fraction:.1%}")
        if args.plot:
            plot_side_by_side(measured, predicted, args.plot)
            print(f"wrote {args.plot}")
        if args.json:
            record = {
                "schedule": args.schedule, "stages": pipe.stages, "chunks": args.chunks,
                "losses": losses,
                "events": [[e.stage, str(e.action), e.start, e.end] for e in measured.events],
            }
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
