"""Rank functions for tests/pipeline/transports/test_wire.py (importable by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dist_harness import outcome


def understated_header(rank: int, world: int, transport: str) -> tuple[str, float]:
    """Rank 0's headers understate the first tensor of each message by a row (its
    ``encode_header`` replaced by one that lies), so its messages are larger than they
    announce; both ranks step. This rank's (outcome, seconds); a rank that aborts reports
    nothing. On a fresh group, which the step leaves unusable; the honest encoder is back
    on return."""
    from pipeline import Distributed, Pipe
    from pipeline.transports import gloo, ordered
    from pipeline.transports.wire import encode_header

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    pipe = Pipe(model, 2, schedule="1f1b", loss_fn=nn.MSELoss(), timeout=10.0,
                distributed=Distributed(dist.new_group(list(range(world))), transport=transport))
    honest = gloo.encode_header, ordered.encode_header
    if rank == 0:
        def understating(metas, kind, stamp=0):  # type: ignore[no-untyped-def]
            (dtype, shape), *rest = metas
            return encode_header(((dtype, (shape[0] - 1, *shape[1:])), *rest), kind, stamp)

        gloo.encode_header = ordered.encode_header = understating
    x = torch.randn(8, 6, dtype=torch.float64)
    said = outcome(lambda: pipe.step(x, x), limit=400)
    gloo.encode_header, ordered.encode_header = honest
    dist.barrier(dist.new_group(list(range(world))))  # neither leaves while the other waits
    return said
