"""Tracing refuses a forward's tensor hooks in the tracing thread only, and patches nothing:
another thread registers hooks meanwhile, and ``torch.Tensor.register_hook`` stays torch's."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from units.errors import TraceError
from units.trace import export_model

WAIT = 60.0  # seconds; the two threads meet well before


class Meeting(nn.Module):
    """Its forward, run by the trace, lets another thread act while the trace is under way."""

    def __init__(self, entered: threading.Event, released: threading.Event) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.entered, self.released = entered, released

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        self.released.wait(WAIT)
        return self.linear(x).relu()


class Hooking(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        out.register_hook(lambda grad: grad * 2)
        return out


def _modes(model: nn.Module) -> tuple[bool, ...]:
    return tuple(module.training for module in model.modules())


def _hook_elsewhere(entered: threading.Event, released: threading.Event,
                    seen: dict[str, Any]) -> None:
    """While the trace waits in the forward: read the class attribute, register a hook on a
    tensor and run its backward; then let the trace go on."""
    try:
        assert entered.wait(WAIT), "the trace never ran the forward"
        seen["during"] = torch.Tensor.__dict__["register_hook"]
        leaf = torch.ones(3, requires_grad=True)
        doubled = leaf * 2
        grads: list[torch.Tensor] = []

        def record(grad: torch.Tensor) -> torch.Tensor:
            grads.append(grad.clone())
            return grad * 10

        doubled.register_hook(record)
        doubled.sum().backward()
        seen["hook_ran"] = len(grads) == 1
        seen["leaf_grad"] = leaf.grad.tolist() if leaf.grad is not None else None
    except BaseException as error:  # noqa: BLE001 - reported to the test's thread
        seen["error"] = error
    finally:
        released.set()


def test_another_thread_registers_hooks_while_a_trace_runs_and_nothing_is_patched() -> None:
    before = torch.Tensor.__dict__["register_hook"]
    entered, released = threading.Event(), threading.Event()
    model = Meeting(entered, released)
    seen: dict[str, Any] = {}
    other = threading.Thread(target=_hook_elsewhere, args=(entered, released, seen))
    other.start()
    try:
        export_model(model, torch.randn(3, 4), _modes(model))
    finally:
        released.set()
        other.join(WAIT)
    assert "error" not in seen, seen.get("error")
    assert seen["during"] is before
    assert torch.Tensor.__dict__["register_hook"] is before
    assert seen["hook_ran"] is True and seen["leaf_grad"] == [20.0, 20.0, 20.0]


def test_the_tracing_thread_still_refuses_a_forwards_hook_and_leaves_torch_as_it_was() -> None:
    before = torch.Tensor.__dict__["register_hook"]
    model = Hooking()
    with pytest.raises(TraceError, match=r"registers a tensor hook at .*test_trace_threads.py:\d+"):
        export_model(model, torch.randn(3, 4), _modes(model))
    assert torch.Tensor.__dict__["register_hook"] is before
    # The mode is gone with the trace: this thread registers hooks again.
    leaf = torch.ones(2, requires_grad=True)
    (leaf * 1).register_hook(lambda grad: grad)
