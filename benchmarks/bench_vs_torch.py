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
(``pipeline.runtime.executor.StepMeter``); ``--trace out.json`` writes our last step's timeline.
Experiment knobs for our gloo transport, read in each rank: ``BENCH_YIELD=0|1``
(``os.sched_yield`` after each send), ``BENCH_LOOKAHEAD=n`` (receives posted ahead, at
least) and ``BENCH_AHEAD_BYTES=n`` (more while their buffers fit in n bytes; 0: no more).

The parts: _vs_torch_model.py (the MLP), _rounds.py (timing steps in rounds),
_vs_torch_ranks.py (the runners, on the ranks), _vs_torch_report.py (the table),
_vs_torch_compare.py (``--model``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from _rounds import QUIET_CORES
from _spawn import LoadMonitor, run_ranks
from _vs_torch_compare import compare
from _vs_torch_model import MODELS, STAGES
from _vs_torch_ranks import rank_main
from _vs_torch_report import (BAR_VS_IDEAL, check_gradients, clean_medians, print_report,
                              wait_for_quiet)


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
    wait_for_quiet(args.wait_quiet)
    started = time.perf_counter()
    with LoadMonitor() as monitor:
        reports = run_ranks(rank_main, STAGES, args.microbatches, args.warmup, args.steps,
                            args.rounds, args.seconds, monitor.latest)
    elapsed = time.perf_counter() - started
    clean_medians(reports[0], monitor)
    met = print_report(reports[0])
    gradients_ok = check_gradients(reports[0])
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
