"""DTensors and FSDP2's sharded modules told apart without importing ``torch.distributed``'s.

That import pulls in sympy (0.6 s of a rank's start here); a process that never built a
DTensor (no tensor parallelism, no FSDP) has no module to import it from, and no DTensor.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor``."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def holds_shards(layers: nn.Module) -> bool:
    """Whether ``layers`` or a module inside is FSDP2's (``fully_shard`` applied to it): for
    a caller the runtime does not yet tell (``ChunkRunner(sharded=None)``)."""
    module = sys.modules.get("torch.distributed.fsdp")
    return module is not None and any(isinstance(m, module.FSDPModule) for m in layers.modules())
