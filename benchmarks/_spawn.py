"""Launch benchmark ranks (through pipeline.launching) and watch other processes' load."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

from pipeline import launching

def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """``pipeline.launching.run_ranks`` with one thread per rank, pinned when PIPESCHED_PIN is
    set, torch and pipeline preloaded."""
    return launching.run_ranks(fn, world, *args, timeout=timeout,
                               pin=bool(os.environ.get("PIPESCHED_PIN")),
                               preload=launching.PRELOAD)


class LoadMonitor:
    """Samples, in a thread, how many cores processes outside this process tree keep busy.

    The benchmarks share their machine; a step that overlaps someone else's burst is not a
    measurement of ours. ``busy_between(start, end)`` (``time.perf_counter`` seconds, which
    on Linux every process reads from the same monotonic clock) says how many cores others
    (or the hypervisor, as steal) took then. ``latest`` holds the last sample in shared
    memory: pass it to the ranks so that they can keep measuring until they have enough
    quiet steps. Linux only; elsewhere it reports zero.
    """

    def __init__(self, interval: float = 0.2) -> None:
        import threading

        self.interval = interval
        self.samples: list[tuple[float, float]] = []  # (end time, cores used by others)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._ours: dict[int, int] = {}  # pid -> CPU ticks when last seen
        self.latest = multiprocessing.get_context("spawn").Value("d", 0.0, lock=False)

    def __enter__(self) -> LoadMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _ours_delta(self) -> int:
        # Per process, so that a process exiting does not take its past ticks with it.
        now = _tree_ticks()
        delta = sum(ticks - self._ours.get(pid, 0) for pid, ticks in now.items())
        self._ours = now
        return delta

    def _run(self) -> None:
        import time

        self._ours_delta()
        previous = (time.perf_counter(), _busy_ticks())
        while not self._stop.wait(self.interval):
            ours = self._ours_delta()
            now = (time.perf_counter(), _busy_ticks())
            elapsed = now[0] - previous[0]
            if elapsed > 0 and now[1] >= 0 <= previous[1]:
                others = (now[1] - previous[1] - ours) / self._tick / elapsed
                self.samples.append((now[0], max(0.0, others)))
                self.latest.value = max(0.0, others)
            previous = now

    def busy_between(self, start: float, end: float) -> float:
        """The most cores others used in any sample overlapping ``[start, end]``."""
        worst, previous_end = 0.0, float("-inf")
        for sample_end, cores in self.samples:
            if sample_end >= start and previous_end <= end:
                worst = max(worst, cores)
            previous_end = sample_end
        return worst

    def mean(self) -> float:
        return sum(c for _, c in self.samples) / len(self.samples) if self.samples else 0.0


def _busy_ticks() -> int:
    """Busy and stolen CPU ticks of the whole machine since boot; -1 if unknown."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return -1
    # user, nice, system, irq, softirq (guest time is inside user and nice already), and
    # steal: time the hypervisor gave this machine's cores to someone else.
    return fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + fields[7]


def _tree_ticks() -> dict[int, int]:
    """CPU ticks (user + system) of this process and each of its descendants."""
    parents: dict[int, int] = {}
    used: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                after = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(entry)] = int(after[1])
        used[int(entry)] = int(after[11]) + int(after[12])
    me = os.getpid()

    def ours(pid: int) -> bool:
        while pid > 1:
            if pid == me:
                return True
            pid = parents.get(pid, 0)
        return False

    return {pid: ticks for pid, ticks in used.items() if ours(pid)}
