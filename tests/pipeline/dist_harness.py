"""Real gloo process groups on localhost for the distributed tests (see pipeline.group.launch)."""

from pipeline.group.launch import free_port, run_ranks, run_ranks_raw

__all__ = ["free_port", "run_ranks", "run_ranks_raw"]
