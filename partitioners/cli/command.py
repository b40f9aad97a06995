"""The ``pipe-balance`` command: profile a model factory's layers and print the balanced cut.

    pipe-balance pkg.module:factory --input-shape 32,1024 --stages 4 [--by time]
        [--memory-limit 8GiB] [--chunks 8 --schedule 1f1b] [--json out.json] [--plot out.png]
    pipe-balance pkg.module:factory --input-shape 256,1024 --stages 4 \
        --schedule auto --chunks auto --memory-limit 2GiB [--top 10] [--json plan.json]

By time, the schedule known, the cut is the one whose simulated step is fastest
(``partitioners.cut.step``), never slower than the min-max cut or the uniform cut it
is printed beside.

With ``--schedule auto`` or ``--chunks auto`` it plans (``partitioners.plan``):
``--input-shape`` is then the whole step's batch, profiled at each micro-batch
size searched, and it prints the best candidates and the pick.

Errors in what was asked (a module that does not import, a shape that does not
parse, more stages than layers, a memory limit no cut meets, ...) print one line
to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from partitioners.cut.balance import BY, balance, check_stages, uniform
from partitioners.cut.report import calibrated_link
from partitioners.cut.step import StepChoice, choose_by_step
from partitioners.cli.loading import (UsageError, build_model, cut_for_command, make_sample,
                                  parse_shapes)
from partitioners.measure.sizes import parse_bytes
from schedules import schedule_names

PROG = "pipe-balance"


# split_backward.SPLIT_MODES, written here so that --help and usage errors need no torch
SPLIT_CHOICES = ("auto", "layers", "graph")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message} (see {PROG} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Profile a model layer by layer (an nn.Sequential's layers, or the units "
                    "any other module is traced and cut into) and cut it into balanced stages.",
    )
    parser.add_argument("factory", help="MODULE:FACTORY, a function returning an nn.Module (an "
                                        "nn.Sequential, or any module torch.export traces)")
    parser.add_argument("--input-shape", required=True, metavar="SHAPE",
                        help="shape of one micro-batch input, e.g. 32,1024; ';' between "
                             "several inputs, e.g. '32,16;32,8'")
    parser.add_argument("--dtype", default="float32",
                        help="input dtype (float32, int64 or long for token ids: zeros, valid "
                             "indices, ...), or one per input with ';'")
    parser.add_argument("--stages", required=True, type=int, help="number of pipeline stages")
    parser.add_argument("--by", choices=BY, default="time",
                        help="what to balance (default: time: the cut whose step under "
                             "--schedule simulates fastest, from every cut where they are few, "
                             "else from the min-max cut, the uniform one and their neighbours)")
    parser.add_argument("--memory-limit", metavar="BYTES",
                        help="memory per stage, e.g. 8GiB, 512MB or 1e9")
    parser.add_argument("--bandwidth", metavar="BYTES",
                        help="bytes per second between stages, e.g. 10GB; adds send time to stages")
    parser.add_argument("--chunks", type=_chunks, default=8,
                        help="micro-batches per step, for memory and prediction (default: 8); "
                             "auto: search them (then --input-shape is the whole batch)")
    parser.add_argument("--schedule", default="1f1b",
                        help=f"schedule for memory and prediction: {', '.join(schedule_names())}; "
                             f"auto: search them all, with micro-batches, cut and recomputation")
    parser.add_argument("--optimizer-factor", type=float, default=0.0, metavar="F",
                        help="with auto: optimizer state per parameter byte, counted in memory "
                             "(Adam: 2; default: 0)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="with auto: data-parallel replicas of each stage (default: 1); their "
                             "collectives and, with --fsdp, their shards are planned for")
    parser.add_argument("--fsdp", action="store_true",
                        help="with --replicas: FSDP2 shards each stage over the replicas "
                             "(default: whole copies that all-reduce)")
    parser.add_argument("--reshard-after-forward", action="store_true",
                        help="with --fsdp: free gathered layers after each forward")
    parser.add_argument("--top", type=int, default=10,
                        help="with auto: how many of the best candidates to print (default: 10)")
    parser.add_argument("--split-backward", choices=SPLIT_CHOICES, default="auto",
                        help="how a zero-bubble schedule splits a backward into I and W, as "
                             "Pipe(split_backward=...): auto (large Linear layers defer their "
                             "weight gradients, the graph split elsewhere), layers or graph "
                             "(default: auto)")
    parser.add_argument("--device", default="cpu", help="where to profile (default: cpu)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per layer (default: 1)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per layer (default: 3)")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a figure (e.g. out.png)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; return the exit status (0, or 2 for an error in what was asked)."""
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except UsageError as error:
        message = " ".join(str(error).split())
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    shapes = parse_shapes(args.input_shape)
    memory_limit = _size("--memory-limit", args.memory_limit)
    bandwidth = _size("--bandwidth", args.bandwidth, rate=True)
    if args.chunks != "auto" and args.chunks < 1:
        raise UsageError(f"--chunks must be >= 1, got {args.chunks}")
    if args.stages < 1:
        raise UsageError(f"--stages must be >= 1, got {args.stages}")
    if "auto" in (args.chunks, args.schedule):
        return _run_plan(args, shapes, memory_limit, bandwidth)
    if args.replicas != 1 or args.fsdp or args.reshard_after_forward or args.optimizer_factor:
        raise UsageError("--replicas, --fsdp, --reshard-after-forward and --optimizer-factor "
                         "are the planner's: use them with --schedule auto or --chunks auto")

    from partitioners.cut.memory import held_microbatches
    from partitioners.measure.profile import profile

    _set_threads(args.threads)  # imports torch: after the cheap checks, as it takes a while
    sample = make_sample(shapes, args.dtype)
    model = cut_for_command(build_model(args.factory), sample).units
    _usage(check_stages, len(model), args.stages)
    held = _usage(held_microbatches, args.schedule, args.stages, args.chunks)
    device = _device(args.device)
    costs = _usage(profile, model, sample, device=device, warmup=args.warmup, repeat=args.repeat,
                   progress=False if args.no_progress else None,
                   split_backward=args.split_backward)
    sizes = _usage(balance, costs, args.stages, by=args.by, memory_limit=memory_limit,
                   schedule=args.schedule, microbatches=args.chunks, bandwidth=bandwidth)
    link = calibrated_link(device)  # a hop measured here, in-process: a local copy
    choice = None
    if args.by == "time":
        # min-max bounds the steady state; the schedule known, the step itself is judged
        choice = _usage(choose_by_step, costs, sizes, args.schedule, args.chunks, held=held,
                        bandwidth=bandwidth, link=link, memory_limit=memory_limit)
    _report_cut(args, costs, Cut(sizes, choice), held, device, link, memory_limit, bandwidth)
    return 0


@dataclass(frozen=True)
class Cut:
    """What the balancer found: the min-max cut, and the choice by simulated step (by time)."""

    min_max: list[int]
    choice: StepChoice | None

    @property
    def sizes(self) -> list[int]:
        return list(self.choice.sizes) if self.choice is not None else self.min_max


def _report_cut(args: argparse.Namespace, costs: Any, cut: Cut, held: Any, device: Any,
                link: Any, memory_limit: float | None, bandwidth: float | None) -> None:
    """Print the cut against the uniform one, with the predicted step; write JSON and plot."""
    from partitioners.cut.report import comparison_table, report, stage_table, to_data

    chosen = report(costs, cut.sizes, held, args.schedule, args.chunks, bandwidth, link=link)
    even_sizes = uniform(len(costs), args.stages)
    even = report(costs, even_sizes, held, args.schedule, args.chunks, bandwidth, link=link)
    label = f"by {args.by}"
    print(f"{args.factory}: {len(costs)} layers, input {args.input_shape} {args.dtype}, "
          f"{args.stages} stages by {args.by}, {args.schedule} with {args.chunks} micro-batches\n")
    print(stage_table(chosen))
    print()
    print(comparison_table(chosen, even, label))
    if cut.choice is not None:
        print(_choice_note(cut.choice, cut.min_max, memory_limit is not None))
    print(f"predicted step {chosen.step_time * 1e3:.3f} ms with a calibrated hop (a local copy "
          f"on {device}, measured here: {link.latency * 1e6:.1f} us + bytes at "
          f"{link.bandwidth / 1e9:.2f} GB/s)")
    if args.json:
        data = to_data(chosen)
        data["uniform"] = to_data(even)
        if cut.choice is not None:
            data["chosen_by"] = {"searched": cut.choice.searched,
                                 "exhaustive": cut.choice.exhaustive, "min_max": cut.min_max}
        data["options"] = _options(args, memory_limit, bandwidth)
        _write(args.json, lambda handle: json.dump(data, handle, indent=2))
    if args.plot:
        _plot(chosen, even, label, args.plot)


def _choice_note(choice: StepChoice, min_max: list[int], limited: bool) -> str:
    """How the cut by time was chosen: the fastest simulated step of every cut, or of a climb."""
    fitting = " that fit the memory limit" if limited else ""
    if choice.exhaustive:
        how = f"the fastest simulated step of all {choice.searched} cuts{fitting}"
    else:
        how = (f"the fastest simulated step of {choice.searched} cuts{fitting}, reached "
               f"from the min-max cut and the uniform one a boundary at a time")
    if list(choice.sizes) == min_max:
        return f"(by time: {how}; it is the min-max cut, whose slowest stage is smallest)"
    return (f"(by time: {how}; the min-max cut {min_max}, whose slowest stage is smallest, "
            f"is slower)")


def _set_threads(threads: int | None) -> None:
    """``--threads``: torch's intra-op threads (imports torch)."""
    import torch

    if threads is not None:
        if threads < 1:
            raise UsageError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def _device(text: str) -> Any:
    """``--device`` as a torch.device that this machine has."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise UsageError(f"--device {text!r}: expected a device such as cpu, cuda or cuda:1") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {text}: CUDA is not available here")
    return device


def _chunks(text: str) -> int | str:
    """``--chunks``: an int, or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or auto, got {text!r}") from None


def _run_plan(args: argparse.Namespace, shapes: Any, memory_limit: float | None,
              bandwidth: float | None) -> int:
    """``--schedule auto`` / ``--chunks auto``: search, print the best candidates, write JSON."""
    from partitioners.plan.model import plan_for_model
    from partitioners.plan.report import candidates_table, plan_data
    from partitioners.cut.report import calibrated_link
    from schedules import Link

    if args.top < 1:
        raise UsageError(f"--top must be >= 1, got {args.top}")
    data_parallel = _replicas(args)
    if args.plot:
        raise UsageError("--plot draws one cut; with --schedule auto or --chunks auto, "
                         "use --json and draw the candidates from it")
    _set_threads(args.threads)
    sample = make_sample(shapes, args.dtype)
    model = cut_for_command(build_model(args.factory), sample).units
    # The hop: --bandwidth as given, else a local copy measured here (what threads pay).
    hop = _usage(calibrated_link, args.device) if bandwidth is None else Link(0.0, bandwidth)
    chosen = _usage(
        plan_for_model, model, sample, stages=args.stages, memory_limit=memory_limit,
        hop=hop, devices=[args.device],
        microbatch_counts=None if args.chunks == "auto" else [args.chunks],
        schedules=None if args.schedule == "auto" else [args.schedule],
        warmup=args.warmup, repeat=args.repeat, data_parallel=data_parallel,
        optimizer_factor=args.optimizer_factor, split_backward=args.split_backward)
    print(f"{args.factory}: {len(model)} layers, batch {args.input_shape} {args.dtype}, "
          f"{args.stages} stages; schedule {args.schedule}, micro-batches {args.chunks}\n")
    print(candidates_table(chosen, args.top))
    if args.json:
        data = plan_data(chosen)
        data["options"] = _options(args, memory_limit, bandwidth)
        _write(args.json, lambda handle: json.dump(data, handle, indent=2))
    return 0


def _replicas(args: argparse.Namespace) -> Any:
    """``--replicas``, ``--fsdp``, ``--reshard-after-forward`` as a ``DataParallelism``
    (priced over the hop between stages), or None for one replica."""
    from partitioners.cut.memory import DataParallelism

    if args.optimizer_factor < 0:
        raise UsageError(f"--optimizer-factor must be >= 0, got {args.optimizer_factor:g}")
    if args.replicas < 1:
        raise UsageError(f"--replicas must be >= 1, got {args.replicas}")
    if args.fsdp and args.replicas < 2:
        raise UsageError(f"--fsdp shards a stage over its replicas: it needs --replicas 2 or "
                         f"more, got {args.replicas}")
    if args.reshard_after_forward and not args.fsdp:
        raise UsageError("--reshard-after-forward frees FSDP's gathered layers: it needs --fsdp")
    if args.replicas == 1:
        return None
    return DataParallelism(args.replicas, args.fsdp, args.reshard_after_forward)


def _size(flag: str, text: str | None, rate: bool = False) -> float | None:
    """Bytes (``--memory-limit 2GiB``), or bytes a second with ``rate`` (``--bandwidth 1GB/s``)."""
    if text is None:
        return None
    try:
        return parse_bytes(text.removesuffix("/s") if rate else text)
    except ValueError as error:
        raise UsageError(f"{flag}: {error}") from None


def _usage(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``function``; a ValueError, TypeError, RuntimeError or MemoryError: a UsageError."""
    try:
        return function(*args, **kwargs)
    except (ValueError, TypeError, RuntimeError, MemoryError) as error:
        raise UsageError(str(error) or type(error).__name__) from None


def _options(
    args: argparse.Namespace, memory_limit: float | None, bandwidth: float | None
) -> dict[str, Any]:
    return {
        "factory": args.factory, "input_shape": args.input_shape, "dtype": args.dtype,
        "stages": args.stages, "by": args.by, "memory_limit": memory_limit,
        "bandwidth": bandwidth, "chunks": args.chunks, "schedule": args.schedule,
        "device": args.device, "replicas": args.replicas, "fsdp": args.fsdp,
        "reshard_after_forward": args.reshard_after_forward,
        "optimizer_factor": args.optimizer_factor, "split_backward": args.split_backward,
    }


def _write(path: str, writer: Any) -> None:
    try:
        with open(path, "w", encoding="utf-8") as handle:
            writer(handle)
    except OSError as error:
        raise UsageError(f"cannot write {path}: {error.strerror or error}") from None


def _plot(chosen: Any, even: Any, label: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from partitioners.cut.figure import plot_cut

    try:
        plot_cut(chosen, even, label, path)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot write the plot {path}: {error}") from None
