"""LocalTransport: results crossing stages that run as threads of one process.

Mailboxes never block a sender, so the plan's receives are taken lazily, when an
action needs them: less waiting than the plan allows, which cannot deadlock.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from schedules import CommPlan
from schedules.dependencies import ActionKey

from pipeline.errors import PipelineAborted
from pipeline.payloads.tree import flatten, map_tensors
from pipeline.transports.base import KeyedTransport


def move(payload: Any, device: torch.device) -> Any:
    """Every tensor of a payload on ``device`` (differentiable, like ``Tensor.to``)."""
    return map_tensors(payload, lambda t: t.to(device, non_blocking=True))


class LocalTransport:
    """One mailbox per stage; ``endpoint(stage)`` gives that stage its send/receive pair.

    The receiving stage copies tensors onto its own device (on CUDA, on its own
    stream, after waiting for the event the sender recorded on its stream, so the
    copy overlaps the sender's next compute). When any stage fails, ``abort``
    wakes every waiting stage with a PipelineAborted naming the failed stage.
    """

    def __init__(self, devices: list[torch.device], timeout: float = 600.0) -> None:
        self.devices = devices
        self.timeout = timeout
        self._boxes: list[dict[ActionKey, tuple[Any, Any]]] = [{} for _ in devices]
        self._ready = threading.Condition()
        self._failed: str | None = None

    def abort(self, reason: str) -> None:
        with self._ready:
            if self._failed is None:
                self._failed = reason
            self._ready.notify_all()

    @property
    def aborted(self) -> bool:
        """Whether ``abort`` was called: every wait raises from then on."""
        return self._failed is not None

    def endpoint(self, stage: int) -> LocalEndpoint:
        return LocalEndpoint(self, stage)

    def put(self, destination: int, key: ActionKey, payload: Any, event: Any) -> None:
        with self._ready:
            self._boxes[destination][key] = (payload, event)
            self._ready.notify_all()

    def take(self, stage: int, key: ActionKey, source: int) -> tuple[Any, Any]:
        deadline = time.monotonic() + self.timeout
        with self._ready:
            while key not in self._boxes[stage]:
                if self._failed is not None:
                    raise PipelineAborted(f"stage {stage} stopped: {self._failed}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"stage {stage} waited {self.timeout:.0f}s for {key[0].value}{key[1]}"
                        f"@c{key[2]} from stage {source}"
                    )
                self._ready.wait(remaining)
            return self._boxes[stage].pop(key)


class LocalEndpoint(KeyedTransport):
    """One stage's view of a LocalTransport (a ``Transport``)."""

    def __init__(self, transport: LocalTransport, stage: int) -> None:
        self.transport = transport
        self.stage = stage
        self.device = transport.devices[stage]
        self._sources: dict[ActionKey, int] = {}

    def begin_step(self, plan: CommPlan, stage: int, call: int = 0) -> None:
        # Stages of one process run every call together: no call can cross another.
        self._sources = {op.key: op.peer for op in plan.receives(stage)}

    def finish(self) -> None:
        return None

    def fail(self, origin: int, reason: str) -> None:
        self.transport.abort(reason)

    def close(self) -> None:
        return None

    def send(self, key: ActionKey, destination: int, payload: Any) -> None:
        _check_leaves(payload)
        event = None
        if self.device.type == "cuda":
            # torch declares no types for Event's constructor.
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self.device))
        self.transport.put(destination, key, payload, event)

    def receive(self, key: ActionKey, source: int) -> Any:
        payload, event = self.transport.take(self.stage, key, source)
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            if event is not None:
                stream.wait_event(event)
            with torch.cuda.device(self.device):
                moved = move(payload, self.device)
            for tensor in flatten(payload).tensors:
                if tensor.device == self.device:
                    # Produced on the sender's stream, used on ours: keep the allocator off it.
                    tensor.record_stream(stream)
            return moved
        return move(payload, self.device)


_PLAIN = (type(None), bool, int, float, complex, str)


def _check_leaves(payload: Any) -> None:
    """Refuse a leaf autograd cannot see into: its tensors would get no gradient.

    An object that is not a registered pytree node (an unregistered dataclass, say) is one
    opaque leaf: the next stage would receive it, but the gradients of the tensors inside
    would never flow back. Between ranks the same leaf is refused by ``to_wire``.
    """
    for leaf in flatten(payload).leaves:
        if not isinstance(leaf, (torch.Tensor, *_PLAIN)):
            raise TypeError(
                f"a stage's output holds a {type(leaf).__module__}.{type(leaf).__qualname__}, "
                f"which is not a pytree node: its tensors would get no gradient. Register it "
                f"(torch.utils._pytree.register_dataclass, or register_pytree_node), or send "
                f"tensors in tuples, lists or dicts")
