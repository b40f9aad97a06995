"""Train a character-level GPT on the Python standard library's source, one stage per process.

    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 300 --sample 200 \\
        --plot docs/gpt_loss.png
    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 3 --float64 --compare

The text is every machine's own: a fixed list of standard-library modules, read
from ``sysconfig.get_paths()["stdlib"]``. Characters outside printable ASCII
become ``?``, so the vocabulary (96 characters) is the same everywhere. Each step
trains on random windows, drawn from a generator seeded by the step, so every
rank draws the same batch without any exchange. The model (``examples/gpt.py``)
ties its output head to its token embedding: the first and the last stage each
hold that weight, and each must end a step with its full gradient.

``--compare`` checks the pipeline against the plain model: at every step rank 0
gathers the pipe's parameters into a full copy, runs the same batch through it
unpipelined, and requires the loss and every gradient (gathered from all ranks)
to agree to 1e-10; it needs ``--float64`` and no dropout.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from gpt import gpt, lm_loss  # examples/gpt.py, beside this script
from pipeline import Pipe, gather_state_dict
from pipeline.group.collectives import broadcast_object, gather_objects

MODULES = ("argparse.py", "textwrap.py", "functools.py", "heapq.py", "string.py",
           "difflib.py", "fractions.py", "statistics.py", "dataclasses.py", "enum.py")
CHARACTERS = "\n" + "".join(chr(code) for code in range(32, 127))  # 96 characters
TOLERANCE = 1e-10


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


def layer_grads(model: nn.Sequential) -> dict[str, torch.Tensor]:
    """``"{layer}.{name}"`` -> gradient, for the parameters this process holds.

    A tied parameter appears under each layer holding it; another rank's layers
    (on the ``meta`` device) are left out.
    """
    return {f"{index}.{name}": parameter.grad.detach().cpu()
            for index, layer in enumerate(model)
            for name, parameter in layer.named_parameters()
            if not parameter.is_meta and parameter.grad is not None}


def compare_step(pipe: Pipe, model: nn.Sequential, reference: nn.Sequential | None,
                 loss: float, x: torch.Tensor, y: torch.Tensor) -> str | None:
    """Rank 0: the same step unpipelined. Returns, on every rank, a problem or None."""
    state = gather_state_dict(pipe)
    group, what = dist.group.WORLD, "comparing with the unpipelined model"
    pieces = gather_objects(layer_grads(model), group, pipe.timeout, what)  # never pickled
    verdict = None
    if reference is not None and state is not None:
        verdict = _check_against(reference, state, pieces, loss, x, y)
    return broadcast_object(verdict, 0, group, pipe.timeout, what)


def _check_against(reference: nn.Sequential, state: dict[str, torch.Tensor],
                   pieces: list[dict[str, torch.Tensor]], loss: float, x: torch.Tensor,
                   y: torch.Tensor) -> str | None:
    tied = [state[key] for key in state if key.endswith("token.weight")]
    head = state[f"{len(reference) - 1}.weight"]
    if any(float((copy - head).abs().max()) > 0.0 for copy in tied):
        return "the tied head and embedding weights differ between their stages"
    reference.load_state_dict(state)
    reference.zero_grad(set_to_none=True)
    expected_loss = lm_loss()(reference(x), y)
    expected_loss.backward()
    expected = layer_grads(reference)
    if not abs(expected_loss.item() - loss) < TOLERANCE:
        return f"loss {loss!r}, unpipelined {expected_loss.item()!r}"
    seen = set()
    for rank, grads in enumerate(pieces):
        for key, grad in grads.items():
            seen.add(key)
            difference = float((grad - expected[key]).abs().max())
            if not difference < TOLERANCE:
                return f"rank {rank}: gradient of {key} differs by {difference:.3g}"
    missing = sorted(set(expected) - seen)
    return f"no rank has a gradient for {missing}" if missing else None


def sample(pipe: Pipe, data: torch.Tensor, rows: int, length: int, characters: int) -> str:
    """Continue ``rows`` windows of the text by ``characters`` sampled characters each.

    Every rank runs the pipe's forwards; the last rank, which gets the logits,
    draws the next characters and broadcasts them. Returns the first row's text.
    """
    last = pipe.schedule.placement[-1]
    windows, _ = random_windows(data, rows, length, step=-1)  # seeded apart from training
    written = windows[0].tolist()
    generator = torch.Generator().manual_seed(0)
    pipe.eval()
    with torch.no_grad():
        for _ in range(characters):
            logits = pipe(windows)
            following = torch.zeros(rows, dtype=torch.long)
            if logits is not None:
                probabilities = torch.softmax(logits[:, -1].double() / 0.8, dim=-1)
                following = torch.multinomial(probabilities, 1, generator=generator)[:, 0]
            dist.broadcast(following, src=last)
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


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--checkpoint", default="except_last")
    parser.add_argument("--batch", type=int, default=32, help="windows per step")
    parser.add_argument("--seq", type=int, default=64, help="characters per window")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--drop-path", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--float64", action="store_true", help="train in double precision")
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
    return args


def build(args: argparse.Namespace) -> nn.Sequential:
    torch.manual_seed(0)
    model = gpt(len(CHARACTERS), args.dim, args.layers, args.heads, args.seq,
                drop_path=args.drop_path, dropout=args.dropout)
    return model.to(torch.float64) if args.float64 else model


def main() -> None:
    args = parse_arguments()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # the ranks share this host's cores
    rank = dist.get_rank()
    data = encode(load_text())
    model = build(args)
    reference = build(args) if args.compare and rank == 0 else None
    pipe = Pipe(model, chunks=args.chunks, schedule=args.schedule, checkpoint=args.checkpoint,
                loss_fn=lm_loss(), group=dist.group.WORLD)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.0)
    losses: list[float] = []
    progress = tqdm(range(args.steps), disable=rank != 0, unit="step",
                    desc=f"{args.schedule} x{pipe.stages}")
    for step in progress:
        x, y = random_windows(data, args.batch, args.seq, step)
        loss = pipe.step(x, y).item()
        if args.compare:
            problem = compare_step(pipe, model, reference, loss, x, y)
            if problem is not None:  # every rank stops; rank 0 says why
                raise SystemExit(f"step {step}: pipelined != unpipelined: {problem}"
                                 if rank == 0 else 1)
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
        progress.set_postfix(loss=f"{loss:.3f}")
    text = sample(pipe, data, args.chunks, args.seq, args.sample) if args.sample else ""
    if rank == 0:
        if text:
            print(f"--- {args.seq} characters of the text, then {args.sample} sampled ---")
            print(text)
            print("---")
        print(f"{len(data):,} characters; loss {losses[0]:.3f} -> {losses[-1]:.3f} "
              f"over {args.steps} steps")
        if args.compare:
            print(f"compare: {args.steps} steps equal the unpipelined model's to {TOLERANCE:g}")
        if args.plot:
            title = (f"character-level GPT on the standard library: {pipe.stages} stages, "
                     f"{args.schedule}, {args.chunks} micro-batches")
            plot_losses(losses, args.plot, title)
            print(f"wrote {args.plot}")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
