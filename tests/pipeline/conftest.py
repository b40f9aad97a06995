"""The helpers of tests/pipeline (the spawn harness, ``*_workers.py``, models) by bare name.

Tests import them as ``from dist_harness import run_ranks``, and spawned ranks unpickle a
worker by the same module name: a spawned process starts with this process's ``sys.path``,
so putting ``helpers/`` on it here serves both.
"""

from __future__ import annotations

import sys
from pathlib import Path

HELPERS = str(Path(__file__).resolve().parent / "helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)
