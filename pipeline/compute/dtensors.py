"""DTensors told apart without importing ``torch.distributed.tensor``.

That import pulls in sympy (0.6 s of a rank's start here); a process that never built a
DTensor (no tensor parallelism, no FSDP) has no module to import it from, and no DTensor.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard


if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor``."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)

