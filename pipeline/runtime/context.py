"""The caller's thread-local state (grad mode, autocast, saved-tensor hooks), carried into stages.

PyTorch keeps these per thread. Stage threads start with the defaults, so
``with torch.autocast(...): pipe.step(x, y)`` would silently run in full
precision and ``torch.autograd.graph.save_on_cpu()`` would save nothing to the
CPU. ``CallerState.capture()`` reads them in the caller's thread and
``applied()`` enters the same state in a stage's thread, for the first forward
and the recomputation alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class CallerState:
    """What a stage thread must inherit from the thread that called the Pipe."""

    grad_enabled: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool
    saved_tensor_hooks: Any  # (pack, unpack) or None

    @classmethod
    def capture(cls) -> CallerState:
        autocast = tuple(
            (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in _AUTOCAST_DEVICES
        )
        return cls(
            grad_enabled=torch.is_grad_enabled(),
            autocast=autocast,
            autocast_cache=torch.is_autocast_cache_enabled(),
            saved_tensor_hooks=torch._C._autograd._top_saved_tensors_default_hooks(False),
        )

    @contextmanager
    def applied(self) -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device, enabled, dtype in self.autocast:
                if enabled:
                    stack.enter_context(
                        torch.autocast(device, dtype=dtype, cache_enabled=self.autocast_cache)
                    )
            if self.saved_tensor_hooks is not None:
                pack, unpack = self.saved_tensor_hooks
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
            yield
