"""Real models through every schedule and checkpoint mode, in one process and on 2 gloo ranks.

- GPT (tied head, token-weighted loss with ``-100`` padding, an all-padding
  micro-batch): loss and every gradient equal the unpipelined model's, to 1e-10;
  every rank holding the tied weight ends with its full gradient.
- GPT with dropout and stochastic depth: for one ``torch.manual_seed``, every
  schedule and checkpoint mode gives the same loss and gradients.
- ResNet (BatchNorm, in-place ReLU first in a stage, weighted and smoothed
  cross-entropy): loss and gradients equal the unpipelined model run micro-batch
  by micro-batch; with ``deferred_batch_norm=True`` each BatchNorm updates its
  running statistics once, with every row it saw in the step (for the first one,
  exactly a whole-batch forward's), and once per micro-batch without.
- ResNet on an input that requires grad: ``x.grad`` equals the unpipelined one.

Each sweep runs once per runtime (the ranks in a single launch) and is shared by
the tests below; each test names every failing combination.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

import zoo
import zoo_workers
from dist_harness import run_ranks

TOLERANCE = 1e-10
RUNTIMES = ("one process", "two ranks")


@cache
def results(runtime: str) -> list[dict[str, list[dict[str, Any]]]]:
    """Per process (one, or one per rank): sweep name -> rows."""
    if runtime == "one process":
        return [zoo_workers.run_sweeps(distributed=False)]
    return run_ranks(zoo_workers.on_rank, zoo_workers.STAGES, timeout=600.0)


def _where(rank: int, row: dict[str, Any]) -> str:
    return f"rank {rank} {row['schedule']} checkpoint={row['mode']}"


def _failures(runtime: str, sweep: str, limits: dict[str, float]) -> list[str]:
    """Lines for every row that raised or whose measurement exceeds its limit."""
    problems = []
    for rank, by_sweep in enumerate(results(runtime)):
        for row in by_sweep[sweep]:
            if row["error"] is not None:
                problems.append(f"{_where(rank, row)}: {row['error']}")
                continue
            over = [f"{name} = {row[name]:.3g}" for name, limit in limits.items()
                    if row[name] is not None and not row[name] < limit]  # NaN fails too
            if over:
                problems.append(f"{_where(rank, row)}: {', '.join(over)}")
    return problems


def _every_parameter_compared(runtime: str, sweep: str, keys: list[str]) -> list[str]:
    """Lines for every combination in which some parameter was checked on no rank."""
    problems = []
    by_rank = [by_sweep[sweep] for by_sweep in results(runtime)]
    for rows in zip(*by_rank):
        if any(row["error"] is not None for row in rows):
            continue
        seen = {key for row in rows for key in row["compared"]}
        missing = sorted(set(keys) - seen)
        if missing:
            problems.append(f"{_where(0, rows[0])}: no rank holds {missing}")
    return problems


def _report(problems: list[str]) -> str:
    return f"{len(problems)} failing:\n" + "\n".join(problems)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_gpt_with_tied_head_and_padding_equals_the_whole_batch(runtime: str) -> None:
    problems = _failures(runtime, "gpt_exact", {"loss_error": TOLERANCE, "grad_error": TOLERANCE})
    keys = list(zoo.per_layer_parameters(zoo.tiny_gpt()))
    problems += _every_parameter_compared(runtime, "gpt_exact", keys)
    assert not problems, _report(problems)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_gpt_randomness_is_the_same_for_every_schedule_and_mode(runtime: str) -> None:
    rows_by_rank = [by_sweep["gpt_random"] for by_sweep in results(runtime)]
    problems = [f"{_where(rank, row)}: {row['error']}"
                for rank, rows in enumerate(rows_by_rank) for row in rows
                if row["error"] is not None]
    assert not problems, _report(problems)
    first = [rows[0] for rows in rows_by_rank]
    baseline = {key: torch.tensor(grad) for row in first for key, grad in row["grads"].items()}
    without = results(runtime)[0]["gpt_exact"][0]
    if without["error"] is None:  # the masks must change something, or this proves nothing
        assert abs(first[0]["loss"] - without["loss"]) > 1e-6, "dropout changed nothing"
    for rank, rows in enumerate(rows_by_rank):
        for row in rows[1:]:
            if not abs(row["loss"] - first[rank]["loss"]) < TOLERANCE:
                problems.append(f"{_where(rank, row)}: loss {row['loss']!r} but "
                                f"{_where(rank, first[rank])} gave {first[rank]['loss']!r}")
            for key, grad in row["grads"].items():
                difference = zoo.difference(torch.tensor(grad), baseline[key])
                if not difference < TOLERANCE:
                    problems.append(f"{_where(rank, row)}: {key} gradient differs from "
                                    f"{first[0]['schedule']}/{first[0]['mode']}'s by "
                                    f"{difference:.3g}")
                    break
    assert not problems, _report(problems)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_resnet_with_deferred_batch_norm(runtime: str) -> None:
    problems = _failures(runtime, "resnet_deferred", {
        "loss_error": TOLERANCE, "grad_error": TOLERANCE, "buffer_error": TOLERANCE})
    keys = list(zoo.per_layer_parameters(zoo.resnet()))
    problems += _every_parameter_compared(runtime, "resnet_deferred", keys)
    assert not problems, _report(problems)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_resnet_batch_norm_counts_each_microbatch_once(runtime: str) -> None:
    problems = _failures(runtime, "resnet_per_microbatch", {
        "loss_error": TOLERANCE, "grad_error": TOLERANCE, "buffer_error": TOLERANCE})
    assert not problems, _report(problems)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_input_gradient_equals_the_unpipelined_one(runtime: str) -> None:
    problems = _failures(runtime, "input_grad", {"input_error": TOLERANCE})
    holders = sum(row["input_error"] is not None
                  for by_sweep in results(runtime) for row in by_sweep["input_grad"]
                  if row["error"] is None)
    errors = sum(row["error"] is not None
                 for by_sweep in results(runtime) for row in by_sweep["input_grad"])
    if not errors:
        assert holders == len(zoo_workers.combinations()), "x.grad checked once per combination"
    assert not problems, _report(problems)


def test_deferred_statistics_reference_is_a_whole_batch_forward_where_it_can_be() -> None:
    """The first BatchNorm sees the same rows either way: its deferred update is exactly a
    whole-batch forward's. Deeper ones see rows normalised per micro-batch, so they differ."""
    model = zoo.resnet()
    x, y = zoo.image_batch()
    deferred = zoo.microbatch_reference(model, x, y, zoo.resnet_loss(), 4).deferred_statistics
    whole = zoo.whole_batch_statistics(model, x)
    assert set(deferred) == set(whole)
    first = [key for key in whole if key.startswith("1.")]
    assert len(first) == 3
    assert max(zoo.difference(deferred[k].double(), whole[k].double()) for k in first) < TOLERANCE
    assert zoo.difference(deferred["5.norm2.running_var"], whole["5.norm2.running_var"]) > 1e-6
