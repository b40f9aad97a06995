"""Spawn real gloo process groups on localhost for the distributed tests."""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, queue: Any,
           args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException as error:  # reported to the parent
        queue.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        # Flush the result before leaving without running atexit handlers, which could
        # block on a process group whose peer failed.
        queue.close()
        queue.join_thread()
        os._exit(0)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result.

    Raises AssertionError naming each failed rank; kills every process on the way out.
    """
    results = run_ranks_raw(fn, world, *args, timeout=timeout)
    failures = [f"rank {rank}: {value}" for rank, (status, value) in sorted(results.items())
                if status != "ok"]
    if failures:
        raise AssertionError("\n".join(failures))
    return [results[rank][1] for rank in range(world)]


def run_ranks_raw(fn: Callable[..., Any], world: int, *args: Any,
                  timeout: float = 240.0) -> dict[int, tuple[str, Any]]:
    """Like ``run_ranks`` but returns ``{rank: (status, value)}`` with errors as text."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_entry, args=(fn, rank, world, port, queue, args), daemon=True)
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, status, value = queue.get(timeout=0.2)
                results[rank] = (status, value)
            except queue_module.Empty:
                silent = [r for r, p in enumerate(processes) if r not in results]
                if all(not processes[r].is_alive() for r in silent):
                    break  # the ones left died without a word
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
    for rank in range(world):
        results.setdefault(rank, ("error", "no result (timed out or crashed)"))
    return results
