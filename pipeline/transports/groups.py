"""Extra process groups over one pipeline's ranks, for transports that want separate communicators."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist


def pipeline_groups(group: Any, stage_ranks: Sequence[int], count: int) -> list[Any]:
    """``count`` new process groups over ``stage_ranks``, on ``group``'s backend.

    ``new_group`` is collective over the whole world, so with several pipelines
    (data parallelism) every rank creates every pipeline's groups, in one order:
    the pipelines' rank lists are gathered first. Returns this pipeline's groups.
    """
    backend = dist.get_backend(group)
    pipelines = [tuple(stage_ranks)]
    if dist.get_world_size() != len(stage_ranks):
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, list(stage_ranks))
        pipelines = sorted({tuple(ranks) for ranks in gathered})
    mine: list[Any] = []
    for ranks in pipelines:
        made = [dist.new_group(list(ranks), backend=backend) for _ in range(count)]
        if ranks == tuple(stage_ranks):
            mine = made
    return mine


def destroy(groups: Sequence[Any]) -> None:
    """Destroy process groups made by ``pipeline_groups``; ones already gone are skipped."""
    for made in groups:
        try:
            dist.destroy_process_group(made)
        except (RuntimeError, ValueError):
            pass
