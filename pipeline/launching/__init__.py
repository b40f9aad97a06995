"""Launching local gloo ranks for tests, examples and benchmarks (``run_ranks``), outside the
library's every-step rooms: nothing in ``pipeline`` imports it."""

from pipeline.launching.ranks import (FAILED_PEER_GRACE, PRELOAD, end_processes, free_port,
                                      run_ranks, run_ranks_raw)

__all__ = ["FAILED_PEER_GRACE", "PRELOAD", "end_processes", "free_port", "run_ranks",
           "run_ranks_raw"]
