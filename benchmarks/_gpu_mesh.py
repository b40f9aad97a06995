"""Part [mesh] of gpu_check.py: a pipeline in a 3D device mesh on spawned ranks, one GPU each.

With 4 GPUs, (pp, dp, tp) = (2, 2, 1); with 8, also (2, 2, 2) with ``examples/gpt.py``'s
``tensor_parallel_plan``; NCCL ranks on a mesh of device type ``"cuda"`` (on the CPU, a
gloo dry run of (2, 2, 1)). Each rank builds the mesh once and runs a few combinations of
the float64 GPT against the unpipelined model on the union of the replicas' batches,
answering per combination: loss and gradient errors (sharded gradients gathered), and
the bytes of parameters, gradients and Adam state it holds after an optimizer step. The
parent's watchdog reports a combination without an answer as HANG and kills the ranks
(the shape's remaining combinations are not run).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import queue as queue_module
import time
import traceback
from typing import Any

import torch
from torch import nn

from _gpu_common import (EXACT_CPU, EXACT_GPU, TOLERANCE, Report, Sizes, join_group,
                         layer_grads, make_batch, make_gpt, rank_context, short)
from examples.gpt import lm_loss  # importable once _gpu_common has put the root on sys.path

# (data parallelism, schedule, checkpoint mode); replicated 1F1B is the bytes' baseline.
COMBINATIONS = (("fsdp", "1f1b", "never"), ("fsdp", "zb-v", "never"),
                ("replicate", "1f1b", "never"))
Combination = tuple[str, str, str]


# -- in each rank ---------------------------------------------------------------------------


def rank_main(rank: int, world: int, port: int, backend: str, shape: tuple[int, int, int],
              timeout: float, results: Any) -> None:
    """One spawned rank: the mesh, then one answer per combination."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        device = join_group(rank, world, port, backend, timeout)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("pp", "dp", "tp"))
        sizes = EXACT_GPU if backend == "nccl" else EXACT_CPU
        union = make_batch(dataclasses.replace(sizes, rows=sizes.rows * shape[1]))
        model = make_gpt(sizes, torch.float64)
        expected = reference(model, *union, device)
        part = slice(mesh.get_local_rank("dp") * sizes.rows,
                     (mesh.get_local_rank("dp") + 1) * sizes.rows)
        x, y = (t[part].to(device) for t in union)
        for combination in COMBINATIONS:
            answer = mesh_step(model, x, y, expected, combination, mesh, sizes, timeout)
            results.put((rank, combination, answer))
    except BaseException as error:  # reported to the parent
        results.put((rank, None, ("error", f"{short(error)}\n{traceback.format_exc()}")))
    finally:
        # Flush the answers, then leave without atexit handlers, which could block on a
        # process group whose peer is gone.
        results.close()
        results.join_thread()
        os._exit(0)


def reference(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor,
              device: torch.device) -> tuple[float, dict[str, Any]]:
    """The unpipelined model's loss and gradients on the union batch."""
    plain = copy.deepcopy(model).to(device)
    loss = lm_loss()(plain(x.to(device)), y.to(device))
    loss.backward()
    return loss.item(), layer_grads(plain)


def mesh_step(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor,
              expected: tuple[float, dict[str, Any]], combination: Combination, mesh: Any,
              sizes: Sizes, timeout: float) -> tuple[str, Any]:
    """("ok", (loss error, gradient error, gradients compared, bytes held)) or ("error", text)."""
    from examples.gpt import tensor_parallel_plan
    from pipeline import Distributed, Pipe

    data_parallel, schedule, mode = combination
    try:
        trained = copy.deepcopy(model)
        pipe = Pipe(trained, sizes.chunks, schedule=schedule, checkpoint=mode,
                    loss_fn=lm_loss(), timeout=timeout, distributed=Distributed.from_mesh(
                        mesh, data_parallel=data_parallel,
                        tensor_parallel=tensor_parallel_plan if mesh["tp"].size() > 1 else None))
        loss = float(pipe.step(x, y))
        grad, compared = gathered_error(trained, expected[1])
        optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-3)
        optimizer.step()
        tensors = [t for p in pipe.parameters() for t in (p, p.grad) if t is not None]
        tensors += [v for state in optimizer.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor)]
        held = sum(local(t).nbytes for t in tensors)
        pipe.close()
        return "ok", (abs(loss - expected[0]), grad, compared, held)
    except Exception as error:  # noqa: BLE001 - one combination's failure, reported
        return "error", short(error)


def local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def gathered_error(model: nn.Sequential, expected: dict[str, Any]) -> tuple[float, int]:
    """Largest gradient difference over the parameters held here, sharded ones gathered
    (every rank of a stage gathers the same ones in the same order), and how many."""
    from torch.distributed.tensor import DTensor

    worst, compared = 0.0, 0
    for index, layer in enumerate(model):
        for name, p in layer.named_parameters():
            if p.is_meta:
                continue
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            compared += 1
            value = math.inf if grad is None else float(
                (grad.detach().cpu() - expected[f"{index}.{name}"]).abs().max())
            worst = math.inf if math.isnan(value) else max(worst, value)
    return worst, compared


# -- in the parent --------------------------------------------------------------------------


def mesh_part(report: Report, backend: str) -> None:
    """Part [mesh]: each shape the GPUs allow (gloo: (2, 2, 1) on the CPU)."""
    gpus = torch.cuda.device_count() if backend == "nccl" else 0
    if backend == "nccl" and gpus < 4:
        report.line("mesh", f"skipped: {gpus} GPU(s) here; the smallest mesh, (pp, dp, tp) = "
                            "(2, 2, 1), needs 4 ranks on a GPU each (NCCL refuses two ranks "
                            "on one GPU)")
        return
    shapes = [(2, 2, 1)] + ([(2, 2, 2)] if gpus >= 8 else [])
    timeout, watchdog, startup = (30.0, 60.0, 90.0) if backend == "nccl" else (20.0, 40.0, 60.0)
    for shape in shapes:
        labels = [f"{str(shape).replace(' ', '')} {dp:<9} {schedule:<4} {mode}"
                  for dp, schedule, mode in COMBINATIONS]
        if report.left() < startup + watchdog:
            for label in labels:
                report.skip("mesh", label)
            continue
        report.line("mesh", f"{math.prod(shape)} {backend} ranks, mesh (pp, dp, tp) = {shape} "
                            f"on {'cuda' if backend == 'nccl' else 'cpu'}, GPT float64 "
                            f"against the unpipelined model; watchdog {watchdog:.0f} s")
        run_shape(report, backend, shape, labels, timeout, watchdog, startup)


def run_shape(report: Report, backend: str, shape: tuple[int, int, int], labels: list[str],
              timeout: float, watchdog: float, startup: float) -> None:
    """One spawn of ``shape``'s ranks, judged combination by combination under the watchdog."""
    from pipeline.launching import end_processes, free_port

    world = math.prod(shape)
    context = rank_context()
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=rank_main, daemon=True,
                                 args=(rank, world, port, backend, shape, timeout, results))
                 for rank in range(world)]
    for process in processes:
        process.start()
    answers: dict[Combination, dict[int, tuple[str, Any]]] = {c: {} for c in COMBINATIONS}
    deadline = time.monotonic() + startup + watchdog  # the first also waits for start-up
    try:
        for index, combination in enumerate(COMBINATIONS):
            stopped = wait_for(answers, combination, results, processes, report, deadline)
            if stopped is not None:
                verdict, why = stopped
                if verdict == "NOT RUN":
                    report.skip("mesh", labels[index])
                else:
                    report.outcome("mesh", verdict, labels[index], why)
                for label in labels[index + 1:]:
                    report.skip("mesh", label, "the ranks were stopped")
                return
            judge(report, labels[index], answers[combination])
            deadline = time.monotonic() + watchdog
        held_fact(report, answers)
    finally:
        end_processes(processes, grace=2.0)


def wait_for(answers: dict[Combination, dict[int, tuple[str, Any]]], combination: Combination,
             results: Any, processes: list[Any], report: Report,
             deadline: float) -> tuple[str, str] | None:
    """None once every rank answered ``combination``, else (verdict, why) it never will."""
    world = len(processes)
    while len(answers[combination]) < world:
        if report.left() <= 0:
            return "NOT RUN", "budget"
        if time.monotonic() > deadline:
            missing = sorted(set(range(world)) - set(answers[combination]))
            return "HANG", f"no answer from rank(s) {missing} in time; ranks killed"
        try:
            rank, answered, answer = results.get(timeout=0.2)
        except queue_module.Empty:
            # A rank flushes its answers before it exits: a dead one that has not
            # answered by now never will.
            dead = [r for r, p in enumerate(processes)
                    if not p.is_alive() and r not in answers[combination]]
            if dead:
                return "FAIL", f"rank(s) {dead} ended without an answer"
            continue
        if answered is None:  # a rank failed outside any combination
            return "FAIL", f"rank {rank} at start-up: {answer[1].splitlines()[0]}"
        answers[answered][rank] = answer
    return None


def judge(report: Report, label: str, answers: dict[int, tuple[str, Any]]) -> None:
    """PASS when every rank compared gradients and the worst errors are below 1e-10."""
    failed = [f"rank {r}: {value}" for r, (status, value) in sorted(answers.items())
              if status != "ok"]
    if failed:
        report.outcome("mesh", "FAIL", label, "; ".join(failed)[:300])
        return
    loss = max(value[0] for _, value in answers.values())
    grad = max(value[1] for _, value in answers.values())
    fewest = min(value[2] for _, value in answers.values())
    verdict = "PASS" if loss < TOLERANCE and grad < TOLERANCE and fewest > 0 else "FAIL"
    report.outcome("mesh", verdict, label, f"max loss error {loss:.1e}, max grad error "
                                           f"{grad:.1e} (at least {fewest} per rank)")


def held_fact(report: Report, answers: dict[Combination, dict[int, tuple[str, Any]]]) -> None:
    """The largest bytes of parameters, gradients and Adam state a rank holds, 1F1B."""
    held = {}
    for combination in (("fsdp", "1f1b", "never"), ("replicate", "1f1b", "never")):
        if any(status != "ok" for status, _ in answers[combination].values()):
            return
        held[combination[0]] = max(value[3] for _, value in answers[combination].values())
    report.line("mesh", f"bytes per rank (parameters + gradients + Adam state, 1f1b, largest "
                        f"rank): fsdp {held['fsdp']:,} vs replicate {held['replicate']:,} "
                        f"(ratio {held['fsdp'] / held['replicate']:.2f})")
