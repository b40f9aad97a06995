"""bench_vs_torch, the parent's side of the rounds: wait for quiet, keep the quiet steps, print
the table against torch and the ideal, and check the pipelines' gradients."""

from __future__ import annotations

import time
from typing import Any

import _vs_torch_model
from _rounds import QUIET_CORES, median_ms
from _spawn import LoadMonitor
from _vs_torch_model import BLOCKS, STAGES

BAR_VS_IDEAL = 1.15


def wait_for_quiet(seconds: float) -> float:
    """Wait up to ``seconds`` for a second in which others use under QUIET_CORES cores."""
    deadline = time.perf_counter() + seconds
    with LoadMonitor(interval=1.0) as monitor:
        while time.perf_counter() < deadline:
            time.sleep(0.25)
            if monitor.samples and monitor.samples[-1][1] <= QUIET_CORES:
                break
    return monitor.samples[-1][1] if monitor.samples else 0.0


def _enough(quiet: int, total: int) -> bool:
    return quiet >= max(3, total // 4)


def clean_medians(report: dict[str, Any], monitor: LoadMonitor) -> None:
    """Per runner, the median of the steps no one else's burst overlapped (all, if too few)."""
    for entry in report["by_m"].values():
        entry["step_ms"], entry["clean"] = {}, {}
        for name, steps in entry["samples"].items():
            clean = [end - start for start, end in steps
                     if monitor.busy_between(start, end) <= QUIET_CORES]
            entry["step_ms"][name] = median_ms(clean if _enough(len(clean), len(steps)) else
                                               [end - start for start, end in steps])
            entry["clean"][name] = (len(clean), len(steps))


def print_report(report: dict[str, Any]) -> bool:
    """Print the table; return whether the bar is met."""
    met = True
    width, batch = _vs_torch_model.WIDTH, _vs_torch_model.BATCH
    print(f"MLP {BLOCKS} x (Linear({width},{width}), ReLU), batch {batch}, float32, P={STAGES} "
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


def check_gradients(report: dict[str, Any]) -> bool:
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
