"""Train a character-level GPT on the standard library's source, in a pipeline or a 3D mesh.

    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 300 --sample 200 \\
        --plot docs/gpt_loss.png
    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 3 --float64 --compare
    torchrun --nproc-per-node 8 examples/train_gpt.py --mesh 2,2,2 --steps 3 --batch 8 \\
        --seq 32 --dim 32 --float64 --compare

The text is every machine's own: a fixed list of standard-library modules, read
from ``sysconfig.get_paths()["stdlib"]``. Characters outside printable ASCII
become ``?``, so the vocabulary (96 characters) is the same everywhere. Each step
trains on random windows, drawn from a generator seeded by the step, so every
rank draws the same batch without any exchange. The model (``examples/gpt.py``)
ties its output head to its token embedding: the first and the last stage each
hold that weight, and each must end a step with its full gradient.

Without ``--mesh``, rank r of the world runs stage r. ``--mesh PP,DP,TP`` lays the
``PP * DP * TP`` processes out as a device mesh: the pipeline runs along pp; the dp
replicas each train on their own rows of the step's ``--batch`` windows, with their
stage's layers sharded by FSDP2 or replicated (``--data-parallel``); the tp ranks of a
replica split each block's heads and MLP (``examples/gpt.py``'s
``tensor_parallel_plan``) and read the same rows. Either way a step is the step of
the whole batch, so both runs print the same losses. ``--backend auto`` takes NCCL
(rank r on ``cuda:LOCAL_RANK``) where each local rank has a GPU of its own, else gloo.

``--save DIR`` writes a distributed checkpoint after the last step
(``pipeline.save_checkpoint``); ``--resume DIR`` loads one written by any layout and
trains from its step up to ``--steps``.

``--compare`` checks the pipeline against the plain model, which rank 0 keeps and
trains alongside (same optimizer, same clipping) on each step's whole batch: at every
step each rank sends its loss, its parameters and its gradients (sharded ones gathered
whole), and rank 0 requires every one of them to agree with the plain model's to
1e-10. The parameters are compared before each step and after the last, so every
optimizer update is checked too. It needs ``--float64`` and no dropout.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sysconfig
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from compare_gpt import CLIP, TOLERANCE, Reference, compare_step, stop_on  # beside this script
from gpt import gpt, lm_loss, tensor_parallel_plan  # examples/gpt.py, beside this script
from pipeline import Distributed, Pipe, load_checkpoint, load_into_model, save_checkpoint

MODULES = ("argparse.py", "textwrap.py", "functools.py", "heapq.py", "string.py",
           "difflib.py", "fractions.py", "statistics.py", "dataclasses.py", "enum.py")
CHARACTERS = "\n" + "".join(chr(code) for code in range(32, 127))  # 96 characters
MESH_DIMENSIONS = ("pp", "dp", "tp")


def load_text() -> str:
    """The source of ``MODULES`` (those this Python has), concatenated in that order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = [(root / name).read_text(encoding="utf-8") for name in MODULES
             if (root / name).is_file()]
    if not parts:
        raise FileNotFoundError(f"none of {', '.join(MODULES)} found in {root}")
    return "\n".join(parts)


def encode(text: str) -> torch.Tensor:
    """Character ids (int64); anything outside ``CHARACTERS`` counts as ``?``."""
    index = {character: i for i, character in enumerate(CHARACTERS)}
    unknown = index["?"]
    return torch.tensor([index.get(character, unknown) for character in text], dtype=torch.long)


def random_windows(data: torch.Tensor, rows: int, length: int,
                   step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` windows of ``length`` characters and the characters that follow each."""
    generator = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - length - 1, (rows,), generator=generator)
    offsets = torch.arange(length + 1)
    windows = data[starts[:, None] + offsets]
    return windows[:, :-1], windows[:, 1:]


# -- where each rank stands ------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """This rank's place: the pipeline it runs a stage of, and its data-parallel replica."""

    pipeline_group: dist.ProcessGroup  # the ranks of this rank's pipeline (the world, no mesh)
    replicas: int  # data-parallel replicas, each training on its own rows of a step's batch
    replica: int  # this rank's
    device: torch.device  # where this rank computes and its collectives run
    mesh: DeviceMesh | None


def mesh_sizes(text: str) -> tuple[int, int, int]:
    """``--mesh "2,2,2"`` -> (pp, dp, tp) = (2, 2, 2)."""
    parts = [part.strip() for part in text.split(",")]
    if len(parts) != 3 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(
            f"expected three positive sizes PP,DP,TP (e.g. 2,2,2), got {text!r}")
    pp, dp, tp = (int(part) for part in parts)
    return pp, dp, tp


def backend_for(requested: str) -> str:
    """``"auto"``: NCCL where every local rank can have a GPU of its own, else gloo."""
    if requested != "auto":
        return requested
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks
    return "nccl" if enough else "gloo"


def start(args: argparse.Namespace) -> Layout:
    """Join the process group (and, with ``--mesh``, the device mesh): this rank's Layout.

    Raises:
        SystemExit: ``--mesh`` sizes whose product is not the number of processes.
    """
    backend = backend_for(args.backend)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)  # before init_device_mesh("cuda", ...)
    else:
        torch.set_num_threads(1)  # the ranks share this host's cores
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.mesh is None:
        assert dist.group.WORLD is not None
        return Layout(dist.group.WORLD, 1, 0, device, None)
    needed = math.prod(args.mesh)
    if world != needed:
        dist.destroy_process_group()
        raise SystemExit(f"--mesh {','.join(map(str, args.mesh))} needs pp * dp * tp = {needed} "
                         f"processes, got {world}: run torchrun --nproc-per-node {needed} ..."
                         if rank == 0 else 1)
    mesh = init_device_mesh(device.type, args.mesh, mesh_dim_names=MESH_DIMENSIONS)
    return Layout(mesh["pp"].get_group(), args.mesh[1], mesh.get_local_rank("dp"), device, mesh)


def make_pipe(args: argparse.Namespace, layout: Layout, model: nn.Sequential) -> Pipe:
    """The pipeline over the world group, or along the mesh's pp dimension."""
    distributed = Distributed(layout.pipeline_group)
    if layout.mesh is not None:
        split = tensor_parallel_plan if args.mesh[2] > 1 else None
        distributed = Distributed.from_mesh(layout.mesh, data_parallel=args.data_parallel,
                                            tensor_parallel=split)
    return Pipe(model, chunks=args.chunks, schedule=args.schedule, checkpoint=args.checkpoint,
                loss_fn=lm_loss(), distributed=distributed)


def replica_rows(x: torch.Tensor, y: torch.Tensor,
                 layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's rows of the step's batch (the tp ranks of a replica take the same)."""
    rows = x.shape[0] // layout.replicas
    part = slice(layout.replica * rows, (layout.replica + 1) * rows)
    return x[part], y[part]


# -- training, sampling, reporting -----------------------------------------------------------


def train(args: argparse.Namespace, pipe: Pipe, optimizer: torch.optim.Optimizer,
          layout: Layout, reference: Reference | None, data: torch.Tensor,
          steps: range) -> tuple[list[float], list[float]]:
    """Run ``steps``: the loss of each, and its seconds (the comparison left out)."""
    losses: list[float] = []
    seconds: list[float] = []
    progress = tqdm(steps, disable=dist.get_rank() != 0, unit="step",
                    desc=f"{args.schedule} x{pipe.stages}")
    for step in progress:
        x, y = random_windows(data, args.batch, args.seq, step)  # the whole batch, everywhere
        began = time.perf_counter()
        loss = pipe.step(*replica_rows(x, y, layout)).item()
        took = time.perf_counter() - began
        if args.compare:
            stop_on(compare_step(pipe, layout.device, reference, loss, (x, y)), f"step {step}")
        began = time.perf_counter()
        pipe.clip_grad_norm_(CLIP)
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(took + time.perf_counter() - began)
        losses.append(loss)
        progress.set_postfix(loss=f"{loss:.3f}")
    if args.compare:
        stop_on(compare_step(pipe, layout.device, reference, None, None), "after the last step")
    return losses, seconds


def sample(pipe: Pipe, layout: Layout, data: torch.Tensor, rows: int, length: int,
           characters: int) -> str:
    """Continue ``rows`` windows of the text by ``characters`` sampled characters each.

    Every rank runs the pipe's forwards; in each pipeline the last stage, which gets the
    logits, draws the next characters and broadcasts them. Returns the first row's text.
    """
    last = pipe.schedule.placement[-1]  # the last stage: a rank of the pipeline group
    windows, _ = random_windows(data, rows, length, step=-1)  # seeded apart from training
    written = windows[0].tolist()
    generator = torch.Generator().manual_seed(0)
    pipe.eval()
    with torch.no_grad():
        for _ in range(characters):
            logits = pipe(windows)
            following = torch.zeros(rows, dtype=torch.long)
            if logits is not None:
                probabilities = torch.softmax(logits[:, -1].double().cpu() / 0.8, dim=-1)
                following = torch.multinomial(probabilities, 1, generator=generator)[:, 0]
            following = following.to(layout.device)
            dist.broadcast(following, group=layout.pipeline_group, group_src=last)
            following = following.cpu()
            windows = torch.cat([windows[:, 1:], following[:, None]], dim=1)
            written.append(int(following[0]))
    pipe.train()
    return "".join(CHARACTERS[i] for i in written)


def plot_losses(losses: list[float], path: str, title: str) -> None:
    """The loss per step and its 20-step running mean, against ln(vocabulary)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = 20
    smooth = [sum(losses[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1))
              for i in range(len(losses))]
    figure, axis = plt.subplots(figsize=(8, 4.5))
    axis.plot(losses, color="#9ecae1", linewidth=1, label="loss of each step")
    axis.plot(smooth, color="#08519c", linewidth=2, label=f"mean of the last {window} steps")
    uniform = torch.log(torch.tensor(float(len(CHARACTERS)))).item()
    axis.axhline(uniform, color="grey", linestyle="--", linewidth=1,
                 label=f"uniform guess, ln {len(CHARACTERS)}")
    axis.set_xlabel("step")
    axis.set_ylabel("cross-entropy (nats per character)")
    axis.set_title(title)
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def held_share(pipe: Pipe) -> tuple[int, int]:
    """Parameter elements this rank holds, and its stage's whole count (each once)."""
    parameters = list(pipe.parameters())  # a DTensor's numel() is the whole tensor's
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in parameters)
    return local, sum(p.numel() for p in parameters)


def report(args: argparse.Namespace, pipe: Pipe, first: int, losses: list[float],
           seconds: list[float], characters: int) -> None:
    """Rank 0's summary lines."""
    if args.mesh is not None:
        local, stage = held_share(pipe)
        print(f"mesh (pp, dp, tp) = ({', '.join(map(str, args.mesh))}), {args.data_parallel}: "
              f"rank 0 holds {local:,} of its stage's {stage:,} parameter elements")
    steps = f"{len(losses)} step" if len(losses) == 1 else f"{len(losses)} steps"
    since = f" from step {first}" if first else ""
    print(f"{characters:,} characters; loss {losses[0]:.3f} -> {losses[-1]:.3f} over {steps}"
          f"{since}; median step {statistics.median(seconds) * 1e3:.0f} ms")
    if args.compare:
        verb = "equals" if len(losses) == 1 else "equal"
        print(f"compare: {steps} {verb} the unpipelined model's to {TOLERANCE:g}")
    if args.save:
        print(f"saved step {args.steps} to {args.save}")
    if args.plot:
        title = (f"character-level GPT on the standard library: {pipe.stages} stages, "
                 f"{args.schedule}, {args.chunks} micro-batches")
        plot_losses(losses, args.plot, title)
        print(f"wrote {args.plot}")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="train up to this step")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--checkpoint", default="except_last")
    parser.add_argument("--batch", type=int, default=32,
                        help="windows per step (with --mesh: the dp replicas' together)")
    parser.add_argument("--seq", type=int, default=64, help="characters per window")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--drop-path", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--float64", action="store_true", help="train in double precision")
    parser.add_argument("--mesh", type=mesh_sizes, metavar="PP,DP,TP",
                        help="run in a (pp, dp, tp) device mesh of PP*DP*TP processes")
    parser.add_argument("--data-parallel", choices=("fsdp", "replicate"),
                        help="with --mesh: shard each stage over its dp replicas (fsdp, the "
                             "default) or give each a whole copy (replicate)")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                        help="auto: nccl where each local rank has a GPU, else gloo")
    parser.add_argument("--save", metavar="DIR", help="write a checkpoint after the last step")
    parser.add_argument("--resume", metavar="DIR", help="load a checkpoint and train on from it")
    parser.add_argument("--compare", action="store_true",
                        help="check every step against the unpipelined model (rank 0)")
    parser.add_argument("--plot", help="write the loss curve (PNG) here")
    parser.add_argument("--sample", type=int, default=0, metavar="N",
                        help="after training, print a window of the text and N characters more")
    args = parser.parse_args()
    if args.compare and not args.float64:
        parser.error("--compare checks to 1e-10, which needs --float64")
    if args.compare and (args.dropout or args.drop_path):
        parser.error("--compare needs --dropout 0 --drop-path 0: random masks cannot match "
                     "an unpipelined run")
    check_mesh_arguments(parser, args)
    return args


def check_mesh_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse here what would fail on some ranks only, leaving their peers waiting; fill in
    --data-parallel's default."""
    if args.mesh is None:
        if args.data_parallel is not None:
            parser.error("--data-parallel needs --mesh PP,DP,TP")
        return
    args.data_parallel = args.data_parallel or "fsdp"
    _, replicas, tp = args.mesh
    if args.batch % replicas or args.batch // replicas < args.chunks:
        parser.error(f"--batch {args.batch} must split into {replicas} replicas' equal rows, "
                     f"--chunks {args.chunks} or more each: pass a multiple of {replicas} from "
                     f"{replicas * args.chunks} up")
    if args.heads % tp:
        parser.error(f"tensor parallelism over {tp} ranks splits the heads: --heads "
                     f"{args.heads} is not a multiple of {tp}")


def build(args: argparse.Namespace) -> nn.Sequential:
    torch.manual_seed(0)
    model = gpt(len(CHARACTERS), args.dim, args.layers, args.heads, args.seq,
                drop_path=args.drop_path, dropout=args.dropout)
    return model.to(torch.float64) if args.float64 else model


def adamw(parameters: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)


def main() -> None:
    args = parse_arguments()
    layout = start(args)
    rank = dist.get_rank()
    data = encode(load_text())
    pipe = make_pipe(args, layout, build(args))
    optimizer = adamw(pipe.parameters(), args.lr)
    reference = None
    if args.compare and rank == 0:
        plain = build(args)
        reference = Reference(plain, adamw(plain.parameters(), args.lr))
    first = 0
    if args.resume:
        first = load_checkpoint(pipe, optimizer, args.resume)  # every rank, from any layout
        if reference is not None:
            load_into_model(reference.model, reference.optimizer, args.resume)
        if first >= args.steps:
            raise SystemExit(f"{args.resume} holds step {first}: pass --steps above it"
                             if rank == 0 else 1)
    losses, seconds = train(args, pipe, optimizer, layout, reference, data,
                            range(first, args.steps))
    if args.save:
        save_checkpoint(pipe, optimizer, args.save, step=args.steps)  # every rank
    text = sample(pipe, layout, data, args.chunks, args.seq, args.sample) if args.sample else ""
    if rank == 0:
        if text:
            print(f"--- {args.seq} characters of the text, then {args.sample} sampled ---")
            print(text)
            print("---")
        report(args, pipe, first, losses, seconds, len(data))
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
