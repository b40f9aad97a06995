"""The whole 3D-mesh bar on 8 gloo ranks: every combination against the unpipelined GPT.

Run from the repository root (8 ranks on this host; a few minutes on 2 cores):

    python benchmarks/mesh_exactness.py
    python benchmarks/mesh_exactness.py --shapes 2,2,2 4,2,1

For each (pp, dp, tp) in (2, 2, 2), (2, 4, 1), (4, 2, 1) and (2, 1, 4): data_parallel
fsdp / replicate x schedule 1f1b / zb-h1 / zb-v x checkpoint never / always, 12
combinations, in one spawn of 8 ranks per shape. Each rank runs
``tests/pipeline/helpers/mesh_workers.gpt_exact`` (the worker of
tests/pipeline/runtime/test_mesh.py, which runs a third of this product): the float64
test GPT (tied head on another stage, padded targets) against the unpipelined model on
the union of the replicas' batches. A row per shape and combination gives the worst loss
and gradient error over the ranks and the fewest gradients a rank compared; PASS when
both errors are below 1e-10 and every rank compared some. Exits 1 on any FAIL (a shape
whose ranks fail fails all 12).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# mesh_workers and the zoo it imports
sys.path.insert(0, str(ROOT / "tests" / "pipeline" / "helpers"))

from mesh_workers import gpt_exact  # noqa: E402

from pipeline.launching import run_ranks  # noqa: E402

EXACT = 1e-10
WORLD = 8
SHAPES = ((2, 2, 2), (2, 4, 1), (4, 2, 1), (2, 1, 4))
COMBINATIONS = tuple(itertools.product(("fsdp", "replicate"), ("1f1b", "zb-h1", "zb-v"),
                                       ("never", "always")))


def shape_rows(shape: tuple[int, ...], timeout: float) -> list[tuple[Any, ...]]:
    """(combination, worst loss error, worst gradient error, fewest compared, verdict, note)
    per combination, the worst over the 8 ranks; a failed spawn fails every combination."""
    try:
        per_rank = run_ranks(gpt_exact, WORLD, shape, COMBINATIONS, timeout=timeout)
    except RuntimeError as error:
        first = str(error).splitlines()[0][:160]
        return [(c, float("nan"), float("nan"), 0, "FAIL", first) for c in COMBINATIONS]
    rows = []
    for index, combination in enumerate(COMBINATIONS):
        answers = [rank_rows[index] for rank_rows in per_rank]
        if any(answer[0] != combination for answer in answers):
            rows.append((combination, float("nan"), float("nan"), 0, "FAIL", "out of order"))
            continue
        loss = max(answer[1] for answer in answers)
        grad = max(answer[2] for answer in answers)
        compared = min(answer[3] for answer in answers)
        exact = loss < EXACT and grad < EXACT and compared > 0
        rows.append((combination, loss, grad, compared, "PASS" if exact else "FAIL", ""))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=[",".join(map(str, s)) for s in SHAPES],
                        help="(pp, dp, tp) shapes as pp,dp,tp with pp*dp*tp = 8")
    parser.add_argument("--timeout", type=float, default=1200.0,
                        help="seconds for one shape's 8 ranks to answer")
    args = parser.parse_args(argv)
    shapes = [tuple(int(n) for n in text.split(",")) for text in args.shapes]
    wrong = [s for s in shapes if len(s) != 3 or s[0] * s[1] * s[2] != WORLD]
    if wrong:
        parser.error(f"expected shapes pp,dp,tp with pp*dp*tp = {WORLD}, got {wrong}")

    start = time.monotonic()
    print(f"{'(pp,dp,tp)':<11} {'data_parallel':<13} {'schedule':<8} {'checkpoint':<10} "
          f"{'loss error':>10} {'grad error':>10} {'compared':>8}  verdict", flush=True)
    passed = total = 0
    for shape in shapes:
        began = time.monotonic()
        for (data_parallel, schedule, mode), loss, grad, compared, verdict, note in shape_rows(
                shape, args.timeout):
            total += 1
            passed += verdict == "PASS"
            print(f"{str(shape).replace(' ', ''):<11} {data_parallel:<13} {schedule:<8} "
                  f"{mode:<10} {loss:>10.1e} {grad:>10.1e} {compared:>8}  {verdict} {note}"
                  .rstrip(), flush=True)
        print(f"# {shape}: {time.monotonic() - began:.0f} s", flush=True)
    print(f"mesh exactness: {passed}/{total} combinations exact to {EXACT:g} in "
          f"{time.monotonic() - start:.0f} s", flush=True)
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
