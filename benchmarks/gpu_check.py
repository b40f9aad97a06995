"""GPU check: the environment, exact gradients for every schedule, a bf16 step, NCCL ranks, a mesh.

Run from the repository root on a CUDA machine (at most ``--budget`` seconds, 240 by
default; about a minute on one H200):

    .venv/bin/python benchmarks/gpu_check.py --budget 240 2>&1 | tee gpu_check.log

Parts, each line labelled ``[env]``, ``[exact]``, ``[bf16]``, ``[nccl]``, ``[predict]``,
``[mesh]``, ``[split]`` or ``[summary]``:

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

6. ``[mesh]``: with four or more GPUs, NCCL ranks (one GPU each) run a pipeline in a
   ``"cuda"`` device mesh, (pp, dp, tp) = (2, 2, 1), and with eight also (2, 2, 2) under
   ``examples/gpt.py``'s ``tensor_parallel_plan``: the float64 GPT under FSDP with 1F1B
   and ZB-V, and replicated with 1F1B (checkpoint never), against the unpipelined model
   on the union of the replicas' batches (PASS below 1e-10 in loss and gradients); the
   bytes of parameters, gradients and Adam state per rank, FSDP against replicated, are
   printed as a fact. A watchdog reports a combination without an answer as HANG. With
   fewer GPUs the part is skipped and says why.

7. ``[split]``: the split backward's price on one GPU, ``bench_split_backward.py``'s GPT
   and ResNet stages: B against our I + W and torch.distributed.pipelining's, medians
   of interleaved rounds (figures against issue 22's 1.10 bar, not a verdict: on the
   CPU, Python around the kernels keeps it above; on a GPU it runs ahead of them).

The last line counts PASS / FAIL / HANG and what the budget left out; the exit code is
1 on any FAIL or HANG, else 0. Without CUDA it says so and exits 0. ``--cpu-dry-run``
runs parts 2, 3 and 5 on the CPU at tiny sizes (the script's logic, in seconds);
``--gloo`` adds part 4 on two CPU gloo ranks and part 6 on four ((2, 2, 1) on the CPU),
``--stall-in NAME`` makes rank 1 stall in schedule NAME of part 4 to show the watchdog
at work. Part 4 is ``_gpu_ranks.py``, part 5 ``_gpu_predict.py``, part 6
``_gpu_mesh.py``, and what the parts share (the report, the GPT, gradient checks)
``_gpu_common.py``.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from typing import Callable

import torch

from _gpu_common import (BF16_CPU, BF16_GPU, EXACT_CPU, EXACT_GPU, MODES, PREDICT_GPU,
                         TOLERANCE, Report, Sizes, bounded, budgeted_part, grad_error, lm_loss,
                         make_batch, make_gpt, reference_grads, short,
                         start_rank_server)
from _gpu_mesh import mesh_part
from _gpu_ranks import two_ranks

BF16_LOSS_TOLERANCE = 5e-2


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


def unpipelined_steps(sizes: Sizes, device: str, x: torch.Tensor, y: torch.Tensor, warmup: int,
                      steps: int) -> tuple[float, float, float]:
    """``timed_steps`` of the bf16 GPT without a pipe; the model is freed on return."""
    plain = make_gpt(sizes, torch.bfloat16).to(device)
    loss_fn = lm_loss()

    def plain_step() -> torch.Tensor:
        plain.zero_grad(set_to_none=True)
        loss = loss_fn(plain(x), y)
        loss.backward()
        return loss.detach()

    return timed_steps(plain_step, device.startswith("cuda"), warmup, steps)


def bf16_step(report: Report, device: str, sizes: Sizes, warmup: int, steps: int) -> None:
    from pipeline import Pipe

    cuda = device.startswith("cuda")
    x, y = (t.to(device) for t in make_batch(sizes))
    loss_fn = lm_loss()
    report.line("bf16", f"GPT {sizes.layers + 3} layers dim {sizes.dim}, "
                        f"{sizes.rows} x {sizes.seq} tokens, bf16 params; pipe: 1f1b M={sizes.chunks} "
                        f"except_last on [{device}, {device}]; median of {steps} steps "
                        f"after {warmup}")
    plain_ms, plain_loss, plain_peak = unpipelined_steps(sizes, device, x, y, warmup, steps)
    if cuda:
        torch.cuda.empty_cache()  # the unpipelined model is gone: its memory is not the pipe's
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


# -- the command -----------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    from schedules import schedule_names

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=240.0,
                        help="seconds for the whole check; what does not fit is NOT RUN")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="parts 2, 3 and 5 on the CPU at tiny sizes (no CUDA needed)")
    parser.add_argument("--gloo", action="store_true",
                        help="with --cpu-dry-run: part 4 on two CPU gloo ranks, part 6 on four")
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
    if args.gloo or (not dry and torch.cuda.device_count() >= 2):  # parts 4 and 6 start ranks
        start_rank_server()
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
    if dry and not args.gloo:
        report.line("mesh", "not run: --cpu-dry-run checks parts 2, 3 and 5 only (add --gloo)")
    else:
        mesh_part(report, "gloo" if dry else "nccl")
    split_part(report, dry)
    code = report.summary()
    if report.counts["HANG"]:
        os._exit(code)  # a hung stage thread could block the interpreter's shutdown
    return code


def bf16_part(report: Report, device: str, dry: bool) -> None:
    """Part 3 under what is left of the budget; an exception or a stall is a FAIL / HANG."""
    sizes, warmup, steps = (BF16_CPU, 1, 3) if dry else (BF16_GPU, 3, 10)
    budgeted_part(report, "bf16", "bf16 step", 5.0 if dry else 30.0, 120.0,
                  lambda: bf16_step(report, device, sizes, warmup, steps))


def predict_part(report: Report, dry: bool) -> None:
    """Part 5 under what is left of the budget; an exception or a stall is a FAIL / HANG."""
    from _gpu_predict import predicted_against_measured, stage_devices

    sizes, warmup, steps = (BF16_CPU, 1, 3) if dry else (PREDICT_GPU, 3, 10)

    def run() -> None:
        predicted_against_measured(report, lambda: make_gpt(sizes, torch.float32),
                                   make_batch(sizes), lm_loss(), sizes.chunks,
                                   stage_devices(dry), warmup, steps)

    budgeted_part(report, "predict", "predicted step", 5.0 if dry else 40.0, 150.0, run)


def split_part(report: Report, dry: bool) -> None:
    """Part 7 under what is left of the budget: figures, an exception is a FAIL."""
    from bench_split_backward import BARS, measure

    stages, repeat, warmup = (("gpt",), 2, 1) if dry else (("gpt", "resnet"), 30, 5)

    def run() -> None:
        for name in stages:
            t = measure(name, repeat, warmup, device="cpu" if dry else "cuda:0")
            ours, graph = ((t[f"{path} I"] + t[f"{path} W"]) / t["B"] for path in ("auto", "graph"))
            theirs = (t["torch I"] + t["torch W"]) / t["B"]
            report.line("split", f"{name}: B {t['B'] * 1e3:.3f} ms, I {t['auto I'] * 1e3:.3f}, "
                                 f"W {t['auto W'] * 1e3:.3f}: (I+W)/B {ours:.2f} (bar {BARS[name]:.2f}), "
                                 f"W/B {t['auto W'] / t['B']:.2f}, graph split's {graph:.2f}, "
                                 f"torch's {theirs:.2f}")

    budgeted_part(report, "split", "split backward", 5.0 if dry else 30.0, 120.0, run)


if __name__ == "__main__":
    sys.exit(main())
