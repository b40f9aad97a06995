"""Clipping by the global gradient norm when the gradients are spread over ranks.

The parts of a model's gradients live on the pipeline's stages, and in a mesh also on
the data-parallel replicas (FSDP's shards) and the tensor-parallel ranks. Every rank
sums its parts' ``|g|^p`` and the sums are all-reduced over each group that holds
distinct parts; a part several ranks hold alike (a replica's whole gradient, a norm's
weight on every tensor-parallel rank) counts once: its share is divided by how many
hold it (``data_parallel.replication``). The infinity norm is a max, which repeats
cannot change.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from pipeline.group.collectives import all_reduce
from pipeline.runtime.data_parallel import local_part, replication


def clip_spread_grads(grads: Sequence[torch.Tensor], counted: Sequence[torch.Tensor],
                      groups: dict[str, dist.ProcessGroup | None], max_norm: float,
                      norm_type: float, timeout: float, device: torch.device) -> torch.Tensor:
    """Scale this rank's ``grads`` by the clip coefficient of the global norm; the norm.

    Args:
        grads: every gradient this rank holds (scaled in place).
        counted: those it counts toward the norm (a weight tied across stages counts on
            its owner's stage only).
        groups: ``"pp"`` (required), ``"dp"``, ``"tp"`` -> the group along that dimension,
            or None where there is none.
    """
    present = {name: group for name, group in groups.items() if group is not None}
    sizes = {name: dist.get_world_size(group) for name, group in present.items()
             if name != "pp"}
    zero = torch.zeros((), dtype=torch.float64, device=device)
    if norm_type == float("inf"):
        total = max((local_part(g).abs().max().to(torch.float64) for g in counted
                     if local_part(g).numel()), default=zero).clone()
        for group in present.values():
            all_reduce(total, group, timeout, "clipping gradients", dist.ReduceOp.MAX)
    else:
        total = sum((local_part(g).norm(norm_type).to(torch.float64) ** norm_type
                     / replication(g, sizes) for g in counted), zero).clone()
        for group in present.values():
            all_reduce(total, group, timeout, "clipping gradients")
        total = total ** (1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        local_part(grad).mul_(coefficient.to(grad.dtype))
    return total
