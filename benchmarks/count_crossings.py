"""How many file boundaries one 1F1B micro-batch's forward and backward cross in the library.

Run from the repository root (one process, CPU, a few seconds):

    python benchmarks/count_crossings.py
    python benchmarks/count_crossings.py --layers 8 --verbose

A 2-stage Pipe of Linear+ReLU layers (an ``nn.Sequential``) steps once to warm up, then
steps under ``sys.setprofile`` and ``threading.setprofile`` (the stages run as threads)
with 1 and with 2 micro-batches. Every Python call and return is an event; one crosses a
file boundary when its frame's file and the file of the nearest library frame below it on
the stack differ (so a call from ``chunk.py`` through ``nn.Module.__call__`` into a forward
in ``split_backward/`` counts: torch's frames between them are not the library's). Only
files of the library packages count: ``pipeline/``, ``schedules/``, ``split_backward/``,
``units/``, ``partitioners/``. A round trip into a helper is two crossings.

Printed: crossings and distinct files of the whole step at 1 and 2 micro-batches, and
per micro-batch, the difference between them (what one more micro-batch adds: its F and
B on both stages and their messages, without the step's fixed part). With ``--verbose``,
the file pairs of one micro-batch, most frequent first.

Measured with the defaults (issue 40): 162 crossings in 14 files per micro-batch before
a layer run's guards became one context and a plain B stopped entering ``split_backward/``,
104 in 10 after. Of those, 16 (``executor`` <-> ``schedules.dependencies`` and
``schedules.comm_ops``) are each stage's steps compiled again every step, because
``runtime.runner.Plans.stage`` makes a new ``StageSteps`` per call: kept once a stage, 88.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PACKAGES = ("pipeline", "schedules", "split_backward", "units", "partitioners")
LIBRARY = tuple(str(ROOT / package) + "/" for package in PACKAGES)


def _library_file(frame: FrameType | None) -> str | None:
    """The file of ``frame`` if it is the library's, else None."""
    if frame is None:
        return None
    name = frame.f_code.co_filename
    return name if name.startswith(LIBRARY) else None


def _library_caller(frame: FrameType) -> str | None:
    """The file of the nearest library frame below ``frame`` on its stack."""
    caller = frame.f_back
    while caller is not None:
        found = _library_file(caller)
        if found is not None:
            return found
        caller = caller.f_back
    return None


class CrossingCounter:
    """Counts, across threads, the calls and returns that cross between library files."""

    def __init__(self) -> None:
        self.pairs: Counter[tuple[str, str]] = Counter()
        self.files: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, frame: FrameType, event: str, argument: Any) -> None:
        if event not in ("call", "return"):
            return
        here = _library_file(frame)
        if here is None:
            return
        caller = _library_caller(frame)
        with self._lock:
            self.files.add(here)
            if caller is not None and caller != here:
                self.pairs[(min(caller, here), max(caller, here))] += 1

    @property
    def crossings(self) -> int:
        return sum(self.pairs.values())

    def __enter__(self) -> CrossingCounter:
        threading.setprofile(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def _short(path: str) -> str:
    return str(Path(path).relative_to(ROOT))


def counted_step(microbatches: int, layers: int, width: int) -> CrossingCounter:
    """The crossings of one training step (after one unmeasured step) of a fresh Pipe."""
    import torch
    from torch import nn

    from pipeline import Pipe

    torch.manual_seed(0)
    model = nn.Sequential(*[module for _ in range(layers)
                            for module in (nn.Linear(width, width), nn.ReLU())])
    x = torch.randn(4 * microbatches, width)
    target = torch.randn(4 * microbatches, width)
    with Pipe(model, chunks=microbatches, balance=[layers, layers], devices=["cpu", "cpu"],
              schedule="1f1b", checkpoint="never", loss_fn=nn.MSELoss()) as pipe:
        pipe.step(x, target)
        with CrossingCounter() as counter:
            pipe.step(x, target)
    return counter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="Linear+ReLU pairs a stage")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--verbose", action="store_true", help="the file pairs, per micro-batch")
    arguments = parser.parse_args(argv)
    one = counted_step(1, arguments.layers, arguments.width)
    two = counted_step(2, arguments.layers, arguments.width)
    print(f"1 micro-batch:  {one.crossings} crossings, {len(one.files)} files")
    print(f"2 micro-batches: {two.crossings} crossings, {len(two.files)} files")
    per = two.crossings - one.crossings
    added = two.pairs - one.pairs
    files = {file for pair in added for file in pair}
    print(f"per micro-batch: {per} crossings, {len(files)} files")
    if arguments.verbose:
        for (source, destination), count in added.most_common():
            print(f"  {count:4d}  {_short(source)} <-> {_short(destination)}")
        print("  files:", ", ".join(sorted(_short(f) for f in files)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
