"""The split backward under FSDP (weights resharded after each forward) and tensor parallelism.

One spawn of 4 gloo ranks runs every case (``split_mesh_workers``): the mesh GPT in
float64 under ZB-H1 and ZB-V with ``split_backward="layers"`` (and ``"auto"``), on a
(pp=2, dp=2) mesh with FSDP and ``reshard_after_forward=True`` (W gathers the weights
again after the forward resharded them) and on a (pp=2, tp=2) mesh with DTensor
weights; loss and every gradient equal the unpipelined model's on the union batch.
"""

from __future__ import annotations

from typing import Any

import pytest

import split_mesh_workers  # puts tests/pipeline's helpers on the path
from dist_harness import run_ranks

EXACT = 1e-10


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_ranks(split_mesh_workers.split_on_mesh, 4, timeout=600)


@pytest.mark.parametrize("case", list(split_mesh_workers.CASES))
def test_exact_on_a_mesh(four_ranks: list[dict[str, Any]], case: str) -> None:
    for rank, found in enumerate(four_ranks):
        result = found[case]
        assert not isinstance(result, str), f"rank {rank}: {result}"
        loss_error, grad_error, compared = result
        assert loss_error < EXACT and grad_error < EXACT and compared > 0, (rank, result)
