"""What the parts of gpu_check.py share: the report, the GPT and its batch, gradient checks.

The GPT is ``examples/gpt.py``'s (tied head, padded targets) without randomness, so every
part can compare a pipelined step against the unpipelined model exactly.
"""

from __future__ import annotations

import copy
import math
import multiprocessing
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # examples/ is not an installed package

import torch  # noqa: E402
from torch import nn  # noqa: E402

from examples.gpt import IGNORE_INDEX, gpt, lm_loss  # noqa: E402
from pipeline.launching import PRELOAD  # noqa: E402


MODES = ("always", "except_last", "never")
TOLERANCE = 1e-10


@dataclass(frozen=True)
class Sizes:
    """A GPT and its batch: ``layers + 3`` modules, ``rows`` sequences, ``chunks`` micro-batches."""

    vocab: int
    dim: int
    layers: int
    heads: int
    seq: int
    rows: int
    chunks: int


# Exact sweeps: 4 micro-batches (dualpipe-v needs 2P), an uneven last one, >= 4 layers.
EXACT_GPU = Sizes(vocab=512, dim=64, layers=6, heads=4, seq=32, rows=17, chunks=4)
EXACT_CPU = Sizes(vocab=11, dim=8, layers=3, heads=2, seq=6, rows=7, chunks=4)
BF16_GPU = Sizes(vocab=8192, dim=1024, layers=8, heads=16, seq=512, rows=32, chunks=4)
BF16_CPU = Sizes(vocab=64, dim=32, layers=2, heads=2, seq=16, rows=8, chunks=4)
PREDICT_GPU = Sizes(vocab=8192, dim=1024, layers=8, heads=16, seq=512, rows=32, chunks=8)


class Report:
    """Prints each labelled line at once, and counts the outcomes for the summary."""

    def __init__(self, budget: float) -> None:
        self.start = time.monotonic()
        self.deadline = self.start + budget
        self.budget = budget
        self.counts = {"PASS": 0, "FAIL": 0, "HANG": 0}
        self.not_run: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def line(self, part: str, text: str) -> None:
        print(f"[{part}] {text}", flush=True)

    def outcome(self, part: str, verdict: str, label: str, detail: str) -> None:
        self.counts[verdict] += 1
        self.line(part, f"{verdict:<4} {label}  {detail}")

    def skip(self, part: str, what: str, why: str = "") -> None:
        self.not_run.append(what)
        self.line(part, f"NOT RUN {what} ({why or f'budget: {max(self.left(), 0):.0f} s left'})")

    def summary(self) -> int:
        c = self.counts
        elapsed = time.monotonic() - self.start
        self.line("summary", f"PASS {c['PASS']}  FAIL {c['FAIL']}  HANG {c['HANG']}  "
                             f"NOT RUN {len(self.not_run)}  ({elapsed:.1f} s of {self.budget:.0f} s)")
        bad = c["FAIL"] + c["HANG"]
        verdict = "FAILED" if bad else ("INCOMPLETE" if self.not_run else "OK")
        self.line("summary", f"RESULT {verdict}")
        return 1 if bad else 0


# -- the model, its batch, the reference ----------------------------------------------------


def make_gpt(sizes: Sizes, dtype: torch.dtype, seed: int = 0) -> nn.Sequential:
    """examples/gpt.py's model without randomness (its head tied to the embedding)."""
    torch.manual_seed(seed)
    model = gpt(sizes.vocab, sizes.dim, sizes.layers, sizes.heads, sizes.seq,
                drop_path=0.0, dropout=0.0)
    return model.to(dtype)


def make_batch(sizes: Sizes, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, row r padded from ``seq - r % 3`` on."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, sizes.vocab, (sizes.rows, sizes.seq + 1), generator=generator)
    x, target = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    for row in range(sizes.rows):
        target[row, sizes.seq - row % 3:] = IGNORE_INDEX
    return x, target


def layer_grads(model: nn.Sequential) -> dict[str, torch.Tensor | None]:
    """``"{layer}.{name}"`` -> gradient on the CPU; a tied weight appears under each layer."""
    return {f"{index}.{name}": None if p.grad is None else p.grad.detach().cpu()
            for index, layer in enumerate(model) for name, p in layer.named_parameters()
            if not p.is_meta}


def reference_grads(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor,
                    device: torch.device) -> dict[str, torch.Tensor | None]:
    """The unpipelined model's gradients on the whole batch (the model is not touched)."""
    plain = copy.deepcopy(model).to(device)
    lm_loss()(plain(x.to(device)), y.to(device)).backward()
    return layer_grads(plain)


def grad_error(model: nn.Sequential, expected: dict[str, Any]) -> tuple[float, int]:
    """Largest difference over the parameters held here, and how many were compared."""
    worst, compared = 0.0, 0
    for key, grad in layer_grads(model).items():
        compared += 1
        if grad is None:
            return math.inf, compared
        value = float((grad - expected[key]).abs().max())
        worst = math.inf if math.isnan(value) else max(worst, value)
    return worst, compared


def short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:160]


def bounded(fn: Callable[[], Any], seconds: float) -> tuple[str, Any]:
    """Run ``fn`` in a daemon thread: ("ok", value), ("error", exception) or ("hang", None)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["ok"] = fn()
        except BaseException as error:  # reported by the caller
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True, name="gpu-check")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        return "hang", None
    return ("ok", box["ok"]) if "ok" in box else ("error", box["error"])


def budgeted_part(report: Report, part: str, label: str, needed: float, most: float,
                  fn: Callable[[], Any]) -> None:
    """Run one part's ``fn`` under what is left of the budget: with less than ``needed``
    seconds left it is NOT RUN; it may take ``most`` seconds at most, past which it is a
    HANG; an exception is a FAIL (``fn`` reports its own figures and PASSes)."""
    if report.left() < needed:
        report.skip(part, f"the {label}")
        return
    seconds = min(report.left(), most)
    status, value = bounded(fn, seconds)
    if status == "hang":
        report.outcome(part, "HANG", label, f"not done in {seconds:.0f} s")
    elif status == "error":
        report.outcome(part, "FAIL", label, short(value))


# What the fork server of gpu_check's ranks imports once: run_ranks' modules, and the DTensor
# modules that examples/gpt.py's tensor-parallel plan imports (about a second of each rank's
# start otherwise). None of them touches CUDA. (By name: Python 3.11's fork server imports
# them on its own sys.path, which has neither benchmarks/ nor examples/.)
RANK_PRELOAD = (*PRELOAD, "torch.distributed.tensor.parallel")


def rank_context() -> Any:
    """The multiprocessing context parts 4 and 6 start their ranks from: a fork server that
    has imported ``RANK_PRELOAD`` and never touched CUDA, so that a rank forked from it
    starts in a fraction of a second and may still take a GPU; spawn (a fresh interpreter
    importing torch, seconds) where there is no fork server."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(RANK_PRELOAD))
    return context


def start_rank_server() -> None:
    """Start ``rank_context``'s fork server now: it imports ``RANK_PRELOAD`` (seconds) while
    the first parts run, instead of when the first ranks start."""
    if rank_context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def join_group(rank: int, world: int, port: int, backend: str, timeout: float) -> torch.device:
    """In a spawned rank: this rank's device (``cuda:rank`` under NCCL, made current, and
    ``LOCAL_RANK`` set, which pipeline.group reads) and the default process group joined."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))
    return device
