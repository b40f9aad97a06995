"""Run a function on N local gloo processes: single-host experiments, tests and benchmarks.

Nothing in the library imports this room: a Pipe never launches processes. The processes
come from multiprocessing's fork server where there is one (``spawn`` elsewhere). The fork
server is one per process and multiprocessing's own, so the launcher leaves its settings
alone unless asked: ``preload=`` names modules for it to import once, before its first fork
(``PRELOAD``: torch and pipeline, which the tests and benchmarks pass), and a rank then
starts in about 0.1 s instead of the 1-2 s of importing them itself. Preloads count only
before the fork server starts: the first launch of a process that passes them (or the
caller's own ``set_forkserver_preload``) decides them for the rest of that process. Each
rank still gets the caller's ``sys.path``, working directory and environment as they are
at the call (the environment is handed over explicitly: a forked rank would otherwise see
the fork server's, taken when it started).
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any


FAILED_PEER_GRACE = 30.0  # seconds the other ranks get to answer once one has failed
# What the tests and benchmarks preload (``preload=PRELOAD``): torch and pipeline, with the
# DTensor, FSDP2 and distributed checkpoint modules that mesh, data-parallel and checkpoint
# ranks import, and torch._dynamo, which FSDP2's first fully_shard imports: each 1 s or
# more a rank otherwise (2-4 s on 2 loaded cores). None of them touches CUDA or starts a
# thread.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "torch._dynamo", "pipeline")


def _context(preload: Sequence[str]) -> Any:
    """The multiprocessing context ranks start from: the fork server where there is one,
    asked to import ``preload`` when it starts (nothing is set when ``preload`` is empty)."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        if preload:
            context.set_forkserver_preload(list(preload))
        return context
    return multiprocessing.get_context("spawn")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def end_processes(processes: Sequence[Any], grace: float) -> None:
    """Give each process ``grace`` seconds to end, then kill it; all have ended on return."""
    for process in processes:
        process.join(timeout=grace)
        if process.is_alive():
            process.kill()
            process.join()


def _entry(fn: Callable[..., Any], rank: int, world: int, rendezvous: str, results: Any,
           args: tuple[Any, ...], threads: int, pin: bool, environment: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environment)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)  # the ranks share this host's cores
    os.environ["LOCAL_RANK"] = str(rank)
    if pin and hasattr(os, "sched_setaffinity"):
        # Threads started from here on (gloo's) inherit this rank's core.
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    try:
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as error:  # reported to the parent
        results.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        # Flush the result, then leave without atexit handlers, which could block on a
        # process group whose peer failed.
        results.close()
        results.join_thread()
        os._exit(0)


def run_ranks_raw(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 300.0,
    threads: int = 1,
    pin: bool = False,
    preload: Sequence[str] = (),
) -> dict[int, tuple[str, Any]]:
    """Run ``fn(rank, world, *args)`` on ``world`` new gloo ranks of this host.

    Args:
        fn: an importable (module-level) function; its return value must pickle.
        world: number of processes.
        timeout: seconds to wait for every rank's answer.
        threads: intra-op threads per rank.
        pin: pin rank r to core r (Linux).
        preload: modules the fork server imports once, if it has not started yet
            (``PRELOAD`` for torch and pipeline); empty: its settings are left alone.

    Returns:
        ``{rank: ("ok", result)}`` or ``{rank: ("error", text)}``; a rank that died
        without a word, or did not answer in time (``timeout``, or
        ``FAILED_PEER_GRACE`` after another rank failed), reports an error too. Every
        process has ended when this returns.
    """
    context = _context(preload)
    results = context.Queue()
    # A file, not a TCP port picked beforehand: a port free a moment ago may be taken (by
    # another launch, or as a connection's own port) before rank 0 listens on it.
    folder = tempfile.mkdtemp(prefix="pipesched-ranks-")
    rendezvous = f"file://{os.path.join(folder, 'store')}"
    environment = dict(os.environ)
    processes = [
        context.Process(target=_entry, daemon=True,
                        args=(fn, rank, world, rendezvous, results, args, threads, pin,
                              environment))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    answers: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(answers) < world and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.2)
                answers[rank] = (status, value)
                if status != "ok":
                    # Its peers may wait for it in a collective, or at start-up in the
                    # store, for the process group's whole timeout: give them a moment
                    # to fail too, then report what failed first.
                    deadline = min(deadline, time.monotonic() + FAILED_PEER_GRACE)
            except queue_module.Empty:
                silent = [rank for rank in range(world) if rank not in answers]
                if all(not processes[rank].is_alive() for rank in silent):
                    break  # the ones left died without a word
    finally:
        end_processes(processes, grace=5.0)
        shutil.rmtree(folder, ignore_errors=True)
    for rank in range(world):
        answers.setdefault(rank, ("error", "no result (timed out or crashed)"))
    return answers


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0,
              threads: int = 1, pin: bool = False, preload: Sequence[str] = ()) -> list[Any]:
    """Like ``run_ranks_raw``, but return the results in rank order.

    Raises:
        RuntimeError: naming every rank that failed, with its error.
    """
    answers = run_ranks_raw(fn, world, *args, timeout=timeout, threads=threads, pin=pin,
                            preload=preload)
    failures = [f"rank {rank}: {value}" for rank, (status, value) in sorted(answers.items())
                if status != "ok"]
    if failures:
        raise RuntimeError("\n".join(failures))
    return [answers[rank][1] for rank in range(world)]
