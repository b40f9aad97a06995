"""Extra process groups over one pipeline's ranks, for transports that want separate communicators."""

from __future__ import annotations

from collections.abc import Sequence
import torch
import torch.distributed as dist


def pipeline_groups(group: dist.ProcessGroup, stage_ranks: Sequence[int], count: int
                    ) -> list[dist.ProcessGroup]:
    """``count`` new process groups over ``stage_ranks``, on ``group``'s backend.

    ``new_group`` is collective over the whole world, so with several pipelines
    (data parallelism) every rank creates every pipeline's groups, in one order:
    the pipelines' rank lists are gathered first. Returns this pipeline's groups.
    """
    backend = dist.get_backend(group)
    pipelines = [tuple(stage_ranks)]
    if dist.get_world_size() != len(stage_ranks):
        pipelines = sorted(set(_every_pipeline(stage_ranks)))
    mine: list[dist.ProcessGroup] = []
    for ranks in pipelines:
        made = [dist.new_group(list(ranks), backend=backend) for _ in range(count)]
        if ranks == tuple(stage_ranks):
            mine = made
    return mine


def _every_pipeline(stage_ranks: Sequence[int]) -> list[tuple[int, ...]]:
    """Every rank's pipeline ranks, gathered over the world as int64 rows padded with -1
    (plain numbers, never pickled), each row checked."""
    world = dist.get_world_size()
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
              else torch.device("cpu"))  # where all_gather_object put its bytes
    mine = torch.full((world,), -1, dtype=torch.int64, device=device)
    mine[: len(stage_ranks)] = torch.tensor(list(stage_ranks), dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    pipelines = []
    for rank, row in enumerate(rows):
        values = row.tolist()
        ranks = tuple(value for value in values if value != -1)
        if (not ranks or values[: len(ranks)] != list(ranks) or len(set(ranks)) != len(ranks)
                or not all(0 <= value < world for value in ranks)):
            raise ValueError(f"expected rank {rank}'s pipeline as distinct ranks 0..{world - 1} "
                             f"padded with -1, got {values}")
        pipelines.append(ranks)
    return pipelines


def destroy(groups: Sequence[dist.ProcessGroup]) -> None:
    """Destroy process groups made by ``pipeline_groups``; ones already gone are skipped."""
    for made in groups:
        try:
            dist.destroy_process_group(made)
        except (RuntimeError, ValueError):
            pass
