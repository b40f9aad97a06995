"""A Hugging Face Llama as it is written in a (pp=2, dp=2) mesh: FSDP units are its traced
units; exact against the plain model on the union of the replicas' batches."""

from __future__ import annotations

from tests.pipeline.helpers.dist_harness import run_ranks
from traced_workers import mesh_exact

TOLERANCE = 1e-10
COMBINATIONS = [("fsdp", "zb-v", "always"), ("replicate", "1f1b", "never")]


def test_llama_in_a_mesh_with_fsdp_is_exact() -> None:
    by_rank = run_ranks(mesh_exact, 4, COMBINATIONS)
    for rank, rows in enumerate(by_rank):
        assert len(rows) == len(COMBINATIONS)
        for data_parallel, schedule, mode, loss_error, grad_error, compared in rows:
            where = f"rank {rank}: {data_parallel}, {schedule}, checkpoint={mode}"
            assert loss_error < TOLERANCE, where
            assert grad_error < TOLERANCE, where
            assert compared > 0, where
