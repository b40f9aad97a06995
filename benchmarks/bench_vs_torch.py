"""Step time of our Pipe against torch.distributed.pipelining and the ideal, on gloo ranks.

Run from the repository root (2 ranks, one thread each; one to two minutes):

    python benchmarks/bench_vs_torch.py
    python benchmarks/bench_vs_torch.py --microbatches 8 --pin

The same balanced MLP and batch run, for each M, under our ``Pipe`` (GPipe and
1F1B; with ``checkpoint="never"``, torch's behaviour, and with the default
``"except_last"`` recomputation) and under ``PipelineStage`` with
``ScheduleGPipe`` / ``Schedule1F1B``, stages split by hand. The ideal is
``S(M) x (M+P-1)/(M*P)``: S(M) is one process running the same M micro-batches
with gradient accumulation, measured in this run on rank 0 while rank 1 sleeps
in a barrier. A step is timed barrier to barrier on rank 0. The runners take
turns, round after round, so that drift hits them all alike; a thread in the
parent watches how many cores other processes use, the steps that overlap
someone else's burst are dropped, and the rounds go on (up to ``--seconds`` per
M) until every runner has enough quiet steps. Each figure is the median of its
quiet steps. The bar: ours no slower than torch's at every M, and within 15% of
the ideal at M=8. Exits 1 when the bar is missed, 2 when the pipelines'
gradients disagree with one process's.

With ``--model tiny|mlp`` it instead compares one model at M=8 (``--schedules``), each
side in fresh processes, launches alternating, and prints our step's breakdown per rank
(``pipeline.executor.StepMeter``); ``--trace out.json`` writes our last step's timeline.
Experiment knobs for our gloo transport, read in each rank: ``BENCH_YIELD=0|1``
(``os.sched_yield`` after each send), ``BENCH_LOOKAHEAD=n`` (receives posted ahead, at
least) and ``BENCH_AHEAD_BYTES=n`` (more while their buffers fit in n bytes; 0: no more).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from _spawn import LoadMonitor, run_ranks

if TYPE_CHECKING:
    from pipeline.checkpoint import CheckpointMode

WIDTH, BLOCKS, BATCH = 512, 8, 384  # ~100 ms for a whole-batch step on one thread
MODELS = {"mlp": (1024, 256), "tiny": (16, 64)}  # --model: (width, batch), BLOCKS layers each


def use_model(name: str) -> None:
    """Switch the module's model and batch (in this process: each rank calls it too)."""
    global WIDTH, BATCH
    WIDTH, BATCH = MODELS[name]
STAGES = 2
BAR_VS_IDEAL = 1.15
QUIET_CORES = 0.25  # a step during which other processes used more cores than this is dropped
MIN_QUIET = 8  # quiet steps wanted per runner and M before the rounds stop


def make_model(seed: int = 0) -> Any:
    """The balanced MLP: BLOCKS x (Linear, ReLU), flat, so a uniform cut is balanced."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def make_batch(seed: int = 1) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, WIDTH, generator=generator),
            torch.randn(BATCH, WIDTH, generator=generator))


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def _grad_sq(parameters: Iterable[Any]) -> float:
    """The squared norm of the gradients, to check a pipeline against one process."""
    return sum((float(p.grad.double().pow(2).sum()) for p in parameters if p.grad is not None),
               0.0)


# -- the runners: each gets a fresh model and runs one step per call -----------------------


class OneProcess:
    """The whole model in this process, M micro-batches with gradient accumulation."""

    def __init__(self, microbatches: int) -> None:
        import torch

        self.model = make_model()
        x, y = make_batch()
        self.xs, self.ys = torch.tensor_split(x, microbatches), torch.tensor_split(y, microbatches)
        self.microbatches = microbatches

    def step(self) -> None:
        from torch import nn

        self.model.zero_grad(set_to_none=True)
        for x, y in zip(self.xs, self.ys, strict=True):
            loss = nn.functional.mse_loss(self.model(x), y) / self.microbatches
            loss.backward()  # type: ignore[no-untyped-call]

    def grad_sq(self) -> float:
        return _grad_sq(self.model.parameters())


class Ours:
    """Our Pipe, one stage per rank."""

    def __init__(self, rank: int, microbatches: int, schedule: str,
                 checkpoint: CheckpointMode) -> None:
        import torch.distributed as dist
        from torch import nn

        from pipeline import Pipe

        self.pipe = Pipe(make_model(), chunks=microbatches, schedule=schedule,
                         checkpoint=checkpoint, loss_fn=nn.MSELoss(), group=dist.group.WORLD)
        x, y = make_batch()
        self.x = x if rank == 0 else None
        self.y = y if rank == STAGES - 1 else None
        self.makespans: list[float] = []

    def step(self) -> None:
        self.pipe.zero_grad()
        self.pipe.step(self.x, self.y)

    def after_step(self) -> None:
        """Outside the timed step: reading the timeline waits for its background gather."""
        if self.pipe.timeline is not None:
            self.makespans.append(self.pipe.timeline.makespan)

    def grad_sq(self) -> float:
        return _grad_sq(self.pipe.parameters())


class OursThreads:
    """Our Pipe in one process, a thread per stage (rank 0 only; the other rank idles)."""

    def __init__(self, microbatches: int, schedule: str) -> None:
        from torch import nn

        from pipeline import Pipe

        self.pipe = Pipe(make_model(), chunks=microbatches, schedule=schedule,
                         checkpoint="never", loss_fn=nn.MSELoss(), devices=["cpu"] * STAGES)
        self.x, self.y = make_batch()

    def step(self) -> None:
        self.pipe.zero_grad()
        self.pipe.step(self.x, self.y)

    def grad_sq(self) -> float:
        return _grad_sq(self.pipe.parameters())


class TorchStage:
    """torch.distributed.pipelining: ``module`` (this rank's layers) in a PipelineStage, run
    by ScheduleGPipe or Schedule1F1B; rank 0 feeds the batch, the last rank the targets."""

    def __init__(self, module: Any, rank: int, microbatches: int, schedule: str,
                 loss_fn: Any, batch: tuple[Any, Any]) -> None:
        import torch
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.module = module
        stage = PipelineStage(module, rank, STAGES, torch.device("cpu"))
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        self.schedule = kind(stage, microbatches, loss_fn=loss_fn)
        self.rank = rank
        self.x, self.y = batch

    def step(self) -> None:
        self.module.zero_grad(set_to_none=True)
        if self.rank == 0:
            self.schedule.step(self.x)
        else:
            self.schedule.step(target=self.y, losses=[])

    def grad_sq(self) -> float:
        return _grad_sq(self.module.parameters())


class Torch(TorchStage):
    """torch.distributed.pipelining on this rank's half of the benchmark's model."""

    def __init__(self, rank: int, microbatches: int, schedule: str) -> None:
        from torch import nn

        model = make_model()
        per_stage = len(model) // STAGES
        half = copy.deepcopy(model[rank * per_stage:(rank + 1) * per_stage])
        super().__init__(half, rank, microbatches, schedule, nn.MSELoss(), make_batch())


# -- one rank's work -------------------------------------------------------------------------


def _timed(step: Callable[[], None]) -> tuple[float, float]:
    """(start, end) of one step, barrier to barrier, in ``time.perf_counter`` seconds."""
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    step()
    dist.barrier()
    return started, time.perf_counter()


class Idle:
    """Rank 1's part while rank 0 runs OneProcess alone: nothing (it waits in the barrier)."""

    def step(self) -> None:
        return None


def _measure(rank: int, runners: dict[str, Any], steps: int, rounds: int, seconds: float,
             load: Any) -> dict[str, list[tuple[float, float]]]:
    """Rounds of ``steps`` steps per runner, at least ``rounds``, then on until every runner
    has MIN_QUIET steps that others' load (``load.value``, cores) probably left alone, or
    ``seconds`` have passed. The parent sorts the steps out precisely afterwards."""
    import torch
    import torch.distributed as dist

    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    quiet = dict.fromkeys(runners, 0)
    deadline = time.perf_counter() + seconds
    done = torch.zeros(1)
    count = 0
    while not done.item():
        for name, runner in runners.items():
            for _ in range(steps):
                before = load.value
                start, end = _timed(runner.step)
                samples[name].append((start, end))
                if hasattr(runner, "after_step"):
                    runner.after_step()
                quiet[name] += max(before, load.value) <= QUIET_CORES
        count += 1
        if rank == 0:
            enough = min(quiet.values()) >= MIN_QUIET or time.perf_counter() > deadline
            done.fill_(float(count >= rounds and enough))
        dist.broadcast(done, 0)  # rank 0 decides for both
    return samples


def rank_main(rank: int, world: int, counts: list[int], warmup: int, steps: int, rounds: int,
              seconds: float, load: Any) -> dict[str, Any]:
    """Every measurement of this rank: per M, each runner's steps as (start, end) times."""
    import torch.distributed as dist

    report: dict[str, Any] = {"by_m": {}}
    report["barrier_ms"] = _median_ms([end - start for start, end in
                                       (_timed(lambda: None) for _ in range(50))])
    whole = OneProcess(1) if rank == 0 else Idle()  # the calibration: ~100 ms wanted
    report["whole_batch_ms"] = _median_ms([end - start for start, end in
                                           (_timed(whole.step) for _ in range(8))][2:])
    for microbatches in counts:
        runners: dict[str, Any] = {
            # S(M): rank 0 alone, then both ranks at once (do the two cores slow each other?)
            "single": OneProcess(microbatches) if rank == 0 else Idle(),
            "single, both ranks": OneProcess(microbatches),
        }
        for schedule in ("gpipe", "1f1b"):
            runners[f"ours {schedule}"] = Ours(rank, microbatches, schedule, "never")
            runners[f"ours {schedule} except_last"] = Ours(rank, microbatches, schedule,
                                                           "except_last")
            runners[f"torch {schedule}"] = Torch(rank, microbatches, schedule)
        for runner in runners.values():
            for _ in range(warmup):
                _timed(runner.step)
        samples = _measure(rank, runners, steps, rounds, seconds, load)
        grads = {}
        for name, runner in runners.items():
            gathered: list[Any] = [None] * world
            mine = runner.grad_sq() if hasattr(runner, "grad_sq") else 0.0
            dist.all_gather_object(gathered, mine)
            grads[name] = sum(gathered)
        report["by_m"][microbatches] = {
            "samples": samples,
            "makespan_ms": {name: _median_ms(r.makespans) for name, r in runners.items()
                            if isinstance(r, Ours) and r.makespans},
            "grad_sq": grads,
        }
    return report


# -- the table -------------------------------------------------------------------------------


def _print_report(report: dict[str, Any]) -> bool:
    """Print the table; return whether the bar is met."""
    met = True
    print(f"MLP {BLOCKS} x (Linear({WIDTH},{WIDTH}), ReLU), batch {BATCH}, float32, P={STAGES} "
          f"gloo ranks, 1 thread each; one process steps the whole batch in "
          f"{report['whole_batch_ms']:.1f} ms; an empty barrier-to-barrier step takes "
          f"{report['barrier_ms']:.2f} ms")
    print("ideal = S(M) x (M+P-1)/(M*P). ours: checkpoint='never' (like torch, no recomputation); "
          "ours+rc: the default 'except_last'.")
    header = (f"{'M':>3} {'sched':<5} {'S(M)':>6} {'ideal':>6} | {'ours':>6} {'ours+rc':>7} "
              f"{'torch':>6} | {'ours/torch':>10} {'ours+rc/torch':>13} | {'ours/ideal':>10} "
              f"{'ours+rc/ideal':>13} {'torch/ideal':>11} | {'makespan':>8} {'quiet':>6}")
    print(header)
    print("-" * len(header))
    for microbatches, entry in sorted(report["by_m"].items()):
        steps = entry["step_ms"]
        single = steps["single"]
        ideal = single * (microbatches + STAGES - 1) / (microbatches * STAGES)
        for schedule in ("gpipe", "1f1b"):
            ours, recompute = steps[f"ours {schedule}"], steps[f"ours {schedule} except_last"]
            theirs = steps[f"torch {schedule}"]
            makespan = entry["makespan_ms"].get(f"ours {schedule}", float("nan"))
            names = ["single", f"ours {schedule}", f"ours {schedule} except_last",
                     f"torch {schedule}"]
            fewest = min(entry["clean"][name][0] for name in names)
            noisy = any(not _enough(*entry["clean"][name]) for name in names)
            print(f"{microbatches:>3} {schedule:<5} {single:6.1f} {ideal:6.1f} | {ours:6.1f} "
                  f"{recompute:7.1f} {theirs:6.1f} | {ours / theirs:10.3f} "
                  f"{recompute / theirs:13.3f} "
                  f"| {ours / ideal:10.3f} {recompute / ideal:13.3f} {theirs / ideal:11.3f} | "
                  f"{makespan:8.1f} {fewest:>5}{'!' if noisy else ' '}")
            if ours > theirs:
                met = False
            if microbatches == 8 and schedule == "1f1b" and ours > BAR_VS_IDEAL * ideal:
                met = False
    print("(ms, medians of the quiet steps; makespan: ours' measured timeline, first action to "
          "last, without the step's barrier, loss broadcast and timeline gather; quiet: the fewest "
          "quiet steps behind a figure of the row, '!' where too few and every step counted)")
    both = ", ".join(
        f"M={m}: {entry['step_ms']['single, both ranks'] / entry['step_ms']['single']:.3f}"
        for m, entry in sorted(report["by_m"].items())
    )
    print(f"S(M) with both ranks computing at once / S(M) alone: {both} (above 1: the cores slow "
          "each other, and no pipeline can reach the ideal)")
    return met


def _check_gradients(report: dict[str, Any]) -> bool:
    ok = True
    for microbatches, entry in sorted(report["by_m"].items()):
        reference = entry["grad_sq"]["single"]
        for name, value in entry["grad_sq"].items():
            if name.startswith("single"):
                continue
            if abs(value - reference) > 1e-4 * reference:
                print(f"GRADIENTS DIFFER at M={microbatches}, {name}: |g|^2 {value} vs {reference}")
                ok = False
    return ok


def _clean_medians(report: dict[str, Any], monitor: LoadMonitor) -> None:
    """Per runner, the median of the steps no one else's burst overlapped (all, if too few)."""
    for entry in report["by_m"].values():
        entry["step_ms"], entry["clean"] = {}, {}
        for name, steps in entry["samples"].items():
            clean = [end - start for start, end in steps
                     if monitor.busy_between(start, end) <= QUIET_CORES]
            entry["step_ms"][name] = _median_ms(clean if _enough(len(clean), len(steps)) else
                                                [end - start for start, end in steps])
            entry["clean"][name] = (len(clean), len(steps))


def _enough(quiet: int, total: int) -> bool:
    return quiet >= max(3, total // 4)


def _wait_for_quiet(seconds: float) -> float:
    """Wait up to ``seconds`` for a second in which others use under QUIET_CORES cores."""
    deadline = time.perf_counter() + seconds
    with LoadMonitor(interval=1.0) as monitor:
        while time.perf_counter() < deadline:
            time.sleep(0.25)
            if monitor.samples and monitor.samples[-1][1] <= QUIET_CORES:
                break
    return monitor.samples[-1][1] if monitor.samples else 0.0


# -- --model: ours against torch in fresh processes, alternating, with our step's breakdown ---


def side_main(rank: int, world: int, model: str, side: str, schedule: str, microbatches: int,
              warmup: int, steps: int, trace: str | None) -> dict[str, Any]:
    """One side (ours or torch) in fresh processes: every step's time on this rank (barrier
    before each step), and for ours the step's breakdown from the executor's meter."""
    import torch.distributed as dist

    from pipeline.executor import StepMeter

    use_model(model)
    runner: Any
    if side == "ours":
        runner = Ours(rank, microbatches, schedule, "never")
    elif side == "threads":
        runner = OursThreads(microbatches, schedule) if rank == 0 else Idle()
    else:
        runner = Torch(rank, microbatches, schedule)
    meter = StepMeter()
    if side == "ours":
        runner.pipe._runner.meter = meter
        if os.environ.get("BENCH_YIELD") is not None:  # an experiment: yield after sends or not
            runner.pipe._runner.transport.yield_after_send = os.environ["BENCH_YIELD"] == "1"
        if os.environ.get("BENCH_LOOKAHEAD") is not None:  # receives posted ahead, at least
            runner.pipe._runner.transport.lookahead = int(os.environ["BENCH_LOOKAHEAD"])
        if os.environ.get("BENCH_AHEAD_BYTES") is not None:  # and more within these bytes
            runner.pipe._runner.transport.ahead_bytes = int(os.environ["BENCH_AHEAD_BYTES"])
    for _ in range(warmup):
        _timed(runner.step)
    meter.reset()
    times = []
    for _ in range(steps):
        dist.barrier()
        started = time.perf_counter()
        runner.step()
        times.append(time.perf_counter() - started)
        if hasattr(runner, "after_step"):
            runner.after_step()
    report: dict[str, Any] = {"times": times,
                              "grad_sq": runner.grad_sq() if hasattr(runner, "grad_sq") else 0.0}
    if side == "ours":
        report["meter"] = meter.per_step_ms()
        if trace and rank == 0 and runner.pipe.timeline is not None:
            runner.pipe.timeline.to_chrome_trace(trace)
    return report


def compare(args: argparse.Namespace) -> int:
    """``--model``: per schedule, ours and torch's launched in turn (A B A B ...), each launch
    a fresh pair of processes; a step's time is the slowest rank's, barrier to step end; each
    launch gives the median of its steps, and each side the median of its launches."""
    use_model(args.model)
    microbatches = args.microbatches[0] if args.microbatches != [4, 8, 16] else 8
    print(f"{BLOCKS} x (Linear({WIDTH}), ReLU), batch {BATCH}, M={microbatches}, P={STAGES} gloo "
          f"ranks, 1 thread each; {args.launches} launches per side, alternating; "
          f"{args.steps_per_launch} steps per launch after {args.warmup_steps} warm-up steps")
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min average, {os.cpu_count()} cores)")
    met = True
    with LoadMonitor() as monitor:
        for schedule in args.schedules:
            sides = ("ours", "torch", "threads") if args.threads else ("ours", "torch")
            launches: dict[str, list[float]] = {side: [] for side in sides}
            meters: list[list[dict[str, float]]] = []
            for launch in range(args.launches):
                for side in sides:
                    reports = run_ranks(side_main, STAGES, args.model, side, schedule,
                                        microbatches, args.warmup_steps, args.steps_per_launch,
                                        args.trace if launch == 0 else None)
                    steps = [max(r["times"][i] for r in reports)
                             for i in range(len(reports[0]["times"]))]
                    launches[side].append(_median_ms(steps))
                    if side == "ours":
                        mean = 1e3 * statistics.fmean(steps)
                        meters.append([{**r["meter"], "other": mean - r["meter"]["total"]}
                                       for r in reports])
            ours, theirs = statistics.median(launches["ours"]), statistics.median(launches["torch"])
            ratio = ours / theirs
            print(f"\n{schedule}: ours {ours:.2f} ms, torch {theirs:.2f} ms, ours/torch "
                  f"{ratio:.3f}   (launch medians: ours "
                  f"{' '.join(f'{v:.2f}' for v in launches['ours'])}; torch "
                  f"{' '.join(f'{v:.2f}' for v in launches['torch'])})")
            if args.threads:
                threads = statistics.median(launches["threads"])
                print(f"  ours in one process (a thread per stage): {threads:.2f} ms, "
                      f"/ torch {threads / theirs:.3f}   (launch medians: "
                      f"{' '.join(f'{v:.2f}' for v in launches['threads'])})")
            _print_breakdown(meters)
            bar = 0.8 if args.model == "tiny" else 0.9
            if schedule == "1f1b" and ratio > bar or ratio > 1.0:
                met = False
    print(f"\nother processes kept {monitor.mean():.2f} cores busy on average; load after: "
          f"{os.getloadavg()[0]:.2f}")
    print(f"bar (1f1b ours/torch <= {0.8 if args.model == 'tiny' else 0.9}, every schedule <= 1):"
          f" {'MET' if met else 'MISSED'}")
    return 0 if met else 1


def _print_breakdown(meters: list[list[dict[str, float]]]) -> None:
    """Per rank, the medians over launches of our step's parts (ms per step, means over a
    launch's steps)."""
    parts = ("compute", "wait", "post", "collective", "overhead", "total", "other")
    print(f"  ours, ms/step: {' '.join(f'{p:>10}' for p in parts)}")
    for rank in range(len(meters[0])):
        values = {p: statistics.median(m[rank][p] for m in meters) for p in parts}
        print(f"  rank {rank:<8} {' '.join(f'{values[p]:10.2f}' for p in parts)}")
    print("  compute: the actions (their events); wait: in transport.take and finish (a peer's "
          "message, unpacking); post: in transport.post and begin_step (sends, the yield after "
          "each, receives posted ahead); "
          "collective: the end of the step (reading the loss the backward messages brought, "
          "posting the timeline's background gather; shared and data-parallel gradients); "
          "overhead: the rest of the runner's step (executor, begin_step, step_of, "
          "input gradients); total: the runner's step; other: the benchmark's step (mean of the "
          "slowest rank's, from a barrier) minus total (Pipe.step's checks and split, leaving "
          "the barrier)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS),
                        help="compare ours with torch on this model, launches alternating "
                             "(tiny: 8 x Linear(16)+ReLU, batch 64; mlp: Linear(1024), batch 256)")
    parser.add_argument("--launches", type=int, default=3, help="--model: launches per side")
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"])
    parser.add_argument("--steps-per-launch", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--threads", action="store_true",
                        help="--model: also time our one-process runtime (a thread per stage)")
    parser.add_argument("--trace", metavar="OUT.json",
                        help="--model: write our last step's timeline as a chrome trace")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps per runner per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds at least")
    parser.add_argument("--seconds", type=float, default=40.0,
                        help="per M, keep measuring up to this long for enough quiet steps")
    parser.add_argument("--pin", action="store_true",
                        help="pin rank r (and its gloo threads) to core r")
    parser.add_argument("--wait-quiet", type=float, default=20.0, metavar="SECONDS",
                        help="first wait up to this long for other processes to go quiet")
    args = parser.parse_args(argv)
    if args.model:
        return compare(args)
    if args.pin:
        os.environ["PIPESCHED_PIN"] = "1"  # read by _spawn in each rank
    _wait_for_quiet(args.wait_quiet)
    started = time.perf_counter()
    with LoadMonitor() as monitor:
        reports = run_ranks(rank_main, STAGES, args.microbatches, args.warmup, args.steps,
                            args.rounds, args.seconds, monitor.latest)
    elapsed = time.perf_counter() - started
    _clean_medians(reports[0], monitor)
    met = _print_report(reports[0])
    gradients_ok = _check_gradients(reports[0])
    kept = sum(c for entry in reports[0]["by_m"].values() for c, _ in entry["clean"].values())
    total = sum(n for entry in reports[0]["by_m"].values() for _, n in entry["clean"].values())
    print(f"other processes kept {monitor.mean():.2f} of this machine's cores busy on average; "
          f"{kept} of {total} steps ran with under {QUIET_CORES} cores of others' load and make "
          f"the medians (all steps where too few did)")
    print(f"\nbar (ours <= torch at every M and schedule; ours 1f1b <= {BAR_VS_IDEAL} x ideal at "
          f"M=8): {'MET' if met else 'MISSED'}; gradients match one process: "
          f"{'yes' if gradients_ok else 'NO'}; {elapsed:.0f} s")
    if not gradients_ok:
        return 2
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
