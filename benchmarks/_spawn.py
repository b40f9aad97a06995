"""Launch a function on local gloo ranks for the benchmarks (one thread per rank)."""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

# The spawned ranks import the benchmark module and the packages from the repository root.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, queue: Any,
           args: tuple[Any, ...]) -> None:
    for path in (ROOT, os.path.join(ROOT, "benchmarks")):
        if path not in sys.path:
            sys.path.insert(0, path)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if os.environ.get("PIPESCHED_PIN") and hasattr(os, "sched_setaffinity"):
        # Threads started from here on (gloo's) inherit this rank's core.
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as error:  # reported to the parent, which raises
        queue.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        # Leave without atexit handlers, which could block on a group whose peer failed.
        queue.close()
        queue.join_thread()
        os._exit(0)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result.

    ``fn`` must be importable (a module-level function). Raises RuntimeError naming
    every rank that failed or did not answer within ``timeout`` seconds.
    """
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    processes = [
        context.Process(target=_entry, args=(fn, rank, world, port, queue, args), daemon=True)
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    results: dict[int, tuple[str, Any]] = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            results[rank] = (status, value)
    except Exception:  # a timeout: the missing ranks are reported below
        pass
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
    missing = ("error", "no result (timed out or crashed)")
    failures = [f"rank {rank}: {results.get(rank, missing)[1]}" for rank in range(world)
                if results.get(rank, missing)[0] != "ok"]
    if failures:
        raise RuntimeError("\n".join(failures))
    return [results[rank][1] for rank in range(world)]


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
