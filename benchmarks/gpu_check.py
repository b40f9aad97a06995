"""GPU check: the environment, exact gradients for every schedule, a bf16 step, NCCL ranks.

Run from the repository root on a CUDA machine (at most ``--budget`` seconds, 240 by
default; about a minute on one H200):

    .venv/bin/python benchmarks/gpu_check.py --budget 240 2>&1 | tee gpu_check.log

Parts, each line labelled ``[env]``, ``[exact]``, ``[bf16]``, ``[nccl]`` or ``[summary]``:

1. torch and CUDA versions, the devices, NCCL's availability and version.
2. ``examples/gpt.py``'s GPT (tied head, padded targets, dropout 0) in float64 on
   two stages of ``cuda:0``: every schedule x checkpoint mode against the unpipelined
   model; PASS when the largest gradient difference is below 1e-10.
3. A bf16 GPT step through a 1F1B Pipe against the unpipelined model: median ms of
   the timed steps, their ratio, and each one's peak ``torch.cuda.max_memory_allocated``.
   PASS when the two losses agree to 5e-2 (bf16) and are finite; the times are facts.
4. With two or more GPUs, two spawned NCCL ranks run every schedule (float64, exact
   gradients on each rank). A parent watchdog reports a combination that makes no
   progress as HANG, kills the ranks and starts fresh ones for the rest. With one GPU
   the part is skipped: NCCL refuses two ranks on one device.

5. ``[predict]``: the step ``Pipe.predict`` foresees against the one measured, one
   process, two stages (on two GPUs where there are), a few schedules: makespan and
   bubble before any step and refined after them (``benchmarks/_gpu_predict.py``;
   figures, not a verdict: an exception is a FAIL, a miss of the 10% bar is printed).

The last line counts PASS / FAIL / HANG and what the budget left out; the exit code is
1 on any FAIL or HANG, else 0. Without CUDA it says so and exits 0. ``--cpu-dry-run``
runs parts 2, 3 and 5 on the CPU at tiny sizes (the script's logic, in seconds);
``--gloo`` adds part 4 on two CPU gloo ranks, ``--stall-in NAME`` makes rank 1 stall
in schedule NAME to show the watchdog at work.
"""

from __future__ import annotations

import argparse
import copy
import math
import multiprocessing
import os
import queue as queue_module
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # examples/ is not an installed package

import torch  # noqa: E402
from torch import nn  # noqa: E402

from examples.gpt import IGNORE_INDEX, gpt, lm_loss  # noqa: E402

MODES = ("always", "except_last", "never")
TOLERANCE = 1e-10
BF16_LOSS_TOLERANCE = 5e-2


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


# -- 1. the environment -----------------------------------------------------------------------


def environment(report: Report) -> None:
    import torch.distributed as dist

    report.line("env", f"torch {torch.__version__}  python {sys.version.split()[0]}  "
                       f"CUDA build {torch.version.cuda}")
    report.line("env", f"CUDA available: {torch.cuda.is_available()}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    report.line("env", f"CUDA devices: {count}")
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        report.line("env", f"  cuda:{index} {props.name}  {props.total_memory / 2**30:.0f} GiB  "
                           f"capability {props.major}.{props.minor}")
    nccl = dist.is_available() and dist.is_nccl_available()
    version = "n/a"
    if nccl and count:
        try:
            raw = torch.cuda.nccl.version()
            version = ".".join(map(str, raw)) if isinstance(raw, tuple) else str(raw)
        except Exception as error:  # noqa: BLE001 - a fact to print, not a failure
            version = f"unknown ({short(error)})"
    report.line("env", f"NCCL available: {nccl}  version {version}")


# -- 2. exact gradients, one process ---------------------------------------------------------


def exact_sweep(report: Report, device: str, sizes: Sizes, schedules: list[str],
                step_timeout: float) -> None:
    """Part 2: every schedule x checkpoint mode on two stages of one device, float64."""
    from pipeline import Pipe

    model = make_gpt(sizes, torch.float64)
    x, y = make_batch(sizes)
    expected = reference_grads(model, x, y, torch.device(device))
    report.line("exact", f"GPT {len(model)} layers, {sizes.rows} rows x {sizes.seq} tokens, "
                         f"M={sizes.chunks}, float64, devices [{device}, {device}]")
    for name in schedules:
        for mode in MODES:
            label = f"{name:<16} {mode:<11}"
            if report.left() < step_timeout:
                report.skip("exact", label)
                continue

            def one_step(name: str = name, mode: str = mode) -> tuple[float, int, list[int]]:
                trained = copy.deepcopy(model)
                pipe = Pipe(trained, chunks=sizes.chunks, devices=[device, device],
                            schedule=name, checkpoint=mode, loss_fn=lm_loss(),
                            timeout=step_timeout)
                pipe.step(x, y)
                return (*grad_error(trained, expected), pipe.balance or [])

            status, value = bounded(one_step, step_timeout)
            if status == "hang":
                report.outcome("exact", "HANG", label, f"no answer in {step_timeout:.0f} s; "
                                                        "the rest of this part is not run")
                return
            if status == "error":
                report.outcome("exact", "FAIL", label, short(value))
                continue
            error, compared, balance = value
            verdict = "PASS" if error < TOLERANCE else "FAIL"
            report.outcome("exact", verdict, label, f"max abs grad error {error:.1e} over "
                                                    f"{compared} tensors, balance {balance}")


# -- 3. a bf16 step, timed -------------------------------------------------------------------


def timed_steps(step: Callable[[], torch.Tensor], cuda: bool, warmup: int,
                steps: int) -> tuple[float, float, float]:
    """Median ms of ``steps`` calls after ``warmup``, the first loss, and peak GiB (CUDA)."""
    loss = float(step())
    for _ in range(warmup - 1):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else math.nan
    return 1e3 * statistics.median(times), loss, peak


def gib(value: float) -> str:
    return "n/a (CPU)" if math.isnan(value) else f"{value:.2f} GiB"


def bf16_step(report: Report, device: str, sizes: Sizes, warmup: int, steps: int) -> None:
    from pipeline import Pipe

    cuda = device.startswith("cuda")
    x, y = (t.to(device) for t in make_batch(sizes))
    loss_fn = lm_loss()
    report.line("bf16", f"GPT {sizes.layers + 3} layers dim {sizes.dim}, "
                        f"{sizes.rows} x {sizes.seq} tokens, bf16 params; pipe: 1f1b M={sizes.chunks} "
                        f"except_last on [{device}, {device}]; median of {steps} steps "
                        f"after {warmup}")
    plain = make_gpt(sizes, torch.bfloat16).to(device)

    def plain_step() -> torch.Tensor:
        plain.zero_grad(set_to_none=True)
        loss = loss_fn(plain(x), y)
        loss.backward()
        return loss.detach()

    plain_ms, plain_loss, plain_peak = timed_steps(plain_step, cuda, warmup, steps)
    del plain
    if cuda:
        torch.cuda.empty_cache()
    pipe = Pipe(make_gpt(sizes, torch.bfloat16), chunks=sizes.chunks, devices=[device, device],
                schedule="1f1b", loss_fn=loss_fn)

    def pipe_step() -> torch.Tensor:
        pipe.zero_grad(set_to_none=True)
        return pipe.step(x, y)

    pipe_ms, pipe_loss, pipe_peak = timed_steps(pipe_step, cuda, warmup, steps)
    report.line("bf16", f"unpipelined {plain_ms:8.2f} ms/step  peak {gib(plain_peak)}")
    report.line("bf16", f"pipe (1f1b) {pipe_ms:8.2f} ms/step  peak {gib(pipe_peak)}  "
                        f"ratio pipe/unpipelined {pipe_ms / plain_ms:.2f}")
    difference = abs(pipe_loss - plain_loss) / max(abs(plain_loss), 1e-12)
    ok = math.isfinite(pipe_loss) and math.isfinite(plain_loss) and difference < BF16_LOSS_TOLERANCE
    report.outcome("bf16", "PASS" if ok else "FAIL", "bf16 loss agrees",
                   f"pipe {pipe_loss:.4f} vs unpipelined {plain_loss:.4f} "
                   f"(relative {difference:.1e}, bar {BF16_LOSS_TOLERANCE})")


# -- 4. two ranks (NCCL on GPUs; gloo on the CPU for a dry run) ------------------------------


def rank_main(rank: int, world: int, port: int, backend: str, schedules: list[str],
              stall_in: str | None, timeout: float, results: Any) -> None:
    """One spawned rank: every schedule on a fresh group; one answer per schedule."""
    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(rank)  # pipeline.distributed picks cuda:LOCAL_RANK
    torch.set_num_threads(1)
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout))
        sizes = EXACT_GPU if backend == "nccl" else EXACT_CPU
        model = make_gpt(sizes, torch.float64)
        x, y = make_batch(sizes)
        expected = reference_grads(model, x, y, device)
        for name in schedules:
            if name == stall_in and rank == 1:
                time.sleep(3600)  # --stall-in: the watchdog must report this, not wait
            answer = rank_step(model, x, y, expected, name, sizes.chunks, timeout, device)
            results.put((rank, name, *answer))
    except BaseException as error:  # reported to the parent
        results.put((rank, None, "error", f"{short(error)}\n{traceback.format_exc()}", 0))
    finally:
        # Flush the answers, then leave without atexit handlers, which could block on a
        # process group whose peer is gone.
        results.close()
        results.join_thread()
        os._exit(0)


def rank_step(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, expected: dict[str, Any],
              name: str, chunks: int, timeout: float,
              device: torch.device) -> tuple[str, Any, int]:
    """("ok", max gradient error, tensors compared) or ("error", text, 0)."""
    import torch.distributed as dist

    from pipeline import Pipe

    try:
        group = dist.new_group([0, 1])  # messages a failed step left cannot reach the next
        trained = copy.deepcopy(model)
        pipe = Pipe(trained, chunks=chunks, schedule=name, loss_fn=lm_loss(),
                    group=group, timeout=timeout)
        rank = dist.get_rank()
        first, last = (pipe.schedule.placement[i] == rank for i in (0, -1))
        pipe.step(x.to(device) if first else None, y.to(device) if last else None)
        error, compared = grad_error(trained, expected)
        return "ok", error, compared
    except Exception as error:  # noqa: BLE001 - one schedule's failure, reported
        return "error", short(error), 0


def judge(report: Report, part: str, name: str,
          answers: dict[int, tuple[str, Any, int]]) -> None:
    """PASS when both ranks held gradients and each is within the tolerance."""
    if all(status == "ok" for status, _, _ in answers.values()):
        worst = max(value for _, value, _ in answers.values())
        counts = ", ".join(f"rank {r}: {answers[r][2]}" for r in sorted(answers))
        held = all(answers[r][2] > 0 for r in answers)
        verdict = "PASS" if worst < TOLERANCE and held else "FAIL"
        report.outcome(part, verdict, f"{name:<16}",
                       f"max abs grad error {worst:.1e} (tensors {counts})")
    else:
        errors = "; ".join(f"rank {r}: {answers[r][1]}" for r in sorted(answers)
                           if answers[r][0] != "ok")
        report.outcome(part, "FAIL", f"{name:<16}", errors)


class Ranks:
    """Two spawned ranks running ``schedules``, and their answers by schedule and rank."""

    def __init__(self, backend: str, schedules: list[str], stall_in: str | None,
                 timeout: float) -> None:
        from pipeline.launch import free_port

        context = multiprocessing.get_context("spawn")
        self.results = context.Queue()
        port = free_port()
        self.processes = [
            context.Process(target=rank_main, daemon=True, args=(
                rank, 2, port, backend, schedules, stall_in, timeout, self.results))
            for rank in range(2)
        ]
        for process in self.processes:
            process.start()
        self.answers: dict[str, dict[int, tuple[str, Any, int]]] = {n: {} for n in schedules}

    def wait_for(self, name: str, report: Report, deadline: float) -> str:
        """``"done"``, ``"hang"``, ``"budget"``, ``"dead: ..."`` or ``"start-up: ..."``."""
        while len(self.answers[name]) < 2:
            if time.monotonic() > deadline:
                return "hang"
            if report.left() <= 0:
                return "budget"
            try:
                rank, answered, *answer = self.results.get(timeout=0.2)
            except queue_module.Empty:
                # A rank flushes its answers before it exits: a dead one that has not
                # answered by now never will.
                dead = [f"rank {r} (exit code {p.exitcode})"
                        for r, p in enumerate(self.processes)
                        if not p.is_alive() and r not in self.answers[name]]
                if dead:
                    return f"dead: {', '.join(dead)} ended without an answer"
                continue
            if answered is None:  # a rank failed outside any schedule
                return f"start-up: rank {rank}: {answer[1]}"
            self.answers[answered][rank] = (answer[0], answer[1], answer[2])
        return "done"

    def missing(self, name: str) -> list[int]:
        return sorted(set(range(2)) - set(self.answers[name]))

    def close(self) -> None:
        for process in self.processes:
            process.join(timeout=2)
            if process.is_alive():
                process.kill()
                process.join()


def launch_ranks(report: Report, backend: str, schedules: list[str], stall_in: str | None,
                 timeout: float, watchdog: float, startup: float) -> list[str]:
    """Run ``schedules`` on two fresh ranks; return those left to run after a HANG."""
    ranks = Ranks(backend, schedules, stall_in, timeout)
    deadline = time.monotonic() + startup + watchdog  # the first also waits for start-up
    try:
        for index, name in enumerate(schedules):
            state = ranks.wait_for(name, report, deadline)
            if state == "done":
                judge(report, backend, name, ranks.answers[name])
                deadline = time.monotonic() + watchdog
                continue
            if state == "hang":
                report.outcome(backend, "HANG", f"{name:<16}",
                               f"no answer from rank(s) {ranks.missing(name)} in "
                               f"{watchdog:.0f} s; ranks killed, fresh ones for the rest")
                return schedules[index + 1:]
            if state.startswith("dead"):
                report.outcome(backend, "FAIL", f"{name:<16}",
                               f"{state[6:]}; fresh ranks for the rest")
                return schedules[index + 1:]
            why = ""
            if state.startswith("start-up"):  # every schedule would fail alike
                report.outcome(backend, "FAIL", "start-up", state[10:])
                why = "the ranks did not start"
            for rest in schedules[index:]:
                report.skip(backend, rest, why)
            return []
        return []
    finally:
        ranks.close()


def two_ranks(report: Report, backend: str, schedules: list[str], stall_in: str | None,
              watchdog: float | None) -> None:
    """Part 4: every schedule on two ranks, relaunching after a HANG while the budget lasts."""
    if backend == "nccl" and torch.cuda.device_count() < 2:
        report.line("nccl", f"skipped: {torch.cuda.device_count()} GPU here, and NCCL refuses "
                            "two ranks on one GPU (duplicate GPU detected), so the NCCL runtime "
                            "cannot be checked on this machine")
        return
    timeout, default, startup = (30.0, 45.0, 60.0) if backend == "nccl" else (8.0, 12.0, 30.0)
    watchdog = default if watchdog is None else watchdog
    report.line(backend, f"2 {backend} ranks, GPT float64 M={EXACT_CPU.chunks}, checkpoint "
                        f"except_last; watchdog {watchdog:.0f} s per schedule")
    remaining = list(schedules)
    while remaining:
        if report.left() < watchdog + startup:
            for name in remaining:
                report.skip(backend, name)
            return
        remaining = launch_ranks(report, backend, remaining, stall_in, timeout, watchdog,
                                 startup)


# -- the command -----------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    from schedules import schedule_names

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=240.0,
                        help="seconds for the whole check; what does not fit is NOT RUN")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="parts 2, 3 and 5 on the CPU at tiny sizes (no CUDA needed)")
    parser.add_argument("--gloo", action="store_true",
                        help="with --cpu-dry-run: part 4 on two CPU gloo ranks")
    parser.add_argument("--schedules", default=",".join(schedule_names()),
                        help="comma-separated schedule names (default: every registered one)")
    parser.add_argument("--stall-in", default=None, metavar="NAME",
                        help="rank 1 stalls in schedule NAME of part 4 (shows the watchdog)")
    parser.add_argument("--watchdog", type=float, default=None, metavar="SECONDS",
                        help="part 4: a schedule without an answer for this long is a HANG "
                             "(default 45 on NCCL, 12 on gloo)")
    args = parser.parse_args(argv)
    args.schedules = [name.strip() for name in args.schedules.split(",") if name.strip()]
    unknown = sorted(set(args.schedules) - set(schedule_names()))
    if unknown:
        parser.error(f"unknown schedules {unknown}; expected some of {list(schedule_names())}")
    if args.gloo and not args.cpu_dry_run:
        parser.error("--gloo goes with --cpu-dry-run (on GPUs part 4 uses NCCL)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    report = Report(args.budget)
    environment(report)
    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: nothing to check", flush=True)
        return 0
    device = "cpu" if dry else "cuda:0"
    if dry:
        report.line("env", "--cpu-dry-run: parts 2, 3 and 5 on the CPU at tiny sizes")
    exact_sweep(report, device, EXACT_CPU if dry else EXACT_GPU, args.schedules,
                step_timeout=20.0 if dry else 30.0)
    bf16_part(report, device, dry)
    if dry and not args.gloo:
        report.line("nccl", "not run: --cpu-dry-run checks parts 2, 3 and 5 only (add --gloo)")
    else:
        two_ranks(report, "gloo" if dry else "nccl", args.schedules, args.stall_in,
                  args.watchdog)
    predict_part(report, dry)
    code = report.summary()
    if report.counts["HANG"]:
        os._exit(code)  # a hung stage thread could block the interpreter's shutdown
    return code


def bf16_part(report: Report, device: str, dry: bool) -> None:
    """Part 3 under what is left of the budget; an exception or a stall is a FAIL / HANG."""
    needed = 5.0 if dry else 30.0
    if report.left() < needed:
        report.skip("bf16", "the bf16 step")
        return
    sizes, warmup, steps = (BF16_CPU, 1, 3) if dry else (BF16_GPU, 3, 10)
    seconds = min(report.left(), 120.0)
    status, value = bounded(lambda: bf16_step(report, device, sizes, warmup, steps), seconds)
    if status == "hang":
        report.outcome("bf16", "HANG", "bf16 step", f"not done in {seconds:.0f} s")
    elif status == "error":
        report.outcome("bf16", "FAIL", "bf16 step", short(value))



def predict_part(report: Report, dry: bool) -> None:
    """Part 5 under what is left of the budget; an exception or a stall is a FAIL / HANG."""
    from _gpu_predict import predicted_against_measured, stage_devices

    needed = 5.0 if dry else 40.0
    if report.left() < needed:
        report.skip("predict", "the predicted step")
        return
    sizes, warmup, steps = (BF16_CPU, 1, 3) if dry else (PREDICT_GPU, 3, 10)
    batch = make_batch(sizes)
    seconds = min(report.left(), 150.0)
    status, value = bounded(lambda: predicted_against_measured(
        report, lambda: make_gpt(sizes, torch.float32), batch, lm_loss(), sizes.chunks,
        stage_devices(dry), warmup, steps), seconds)
    if status == "hang":
        report.outcome("predict", "HANG", "predicted step", f"not done in {seconds:.0f} s")
    elif status == "error":
        report.outcome("predict", "FAIL", "predicted step", short(value))


if __name__ == "__main__":
    sys.exit(main())
