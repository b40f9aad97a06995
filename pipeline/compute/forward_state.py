"""State a forward changes (buffers, private generators), put back for its recomputation.

Some layers update state in their forward: BatchNorm's running statistics, spectral
norm's power-iteration vectors (``parametrizations.spectral_norm`` refines ``_u`` and
``_v`` in place on every training forward, then normalises the weight with them). A
recomputation that ran with the state as it is by then would compute another weight
than the forward did, and update the state a second time. So before the forward of a
micro-batch that will be recomputed, the buffers a forward writes are copied; the
recomputation runs with those copies in place and the live values are put back after
it. Which buffers a forward writes is found, not declared: by their version counters
(every in-place write bumps one) across the first recomputed forward; until then every
buffer is copied once.

A layer may also draw from a ``torch.Generator`` of its own (``torch.bernoulli(p,
generator=self.generator)``): each draw moves it, so a recomputation would draw the next
numbers, not the forward's (``torch.utils.checkpoint`` has the same gap). The generators
a chunk's modules hold as attributes (or in a list, tuple or dict attribute) are found
when the chunk is built; their states are read before each forward and, for a
recomputation, set back for its duration. A generator the attributes do not show (one
captured in a closure, or a global) cannot be found: a layer drawing from it is exact
without recomputation only (tests/pipeline/compute/test_detection.py shows the limit). A
generator shared by layers of two chunks is drawn in the order the stages run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Snapshot = dict[str, torch.Tensor]


class WrittenBuffers:
    """The buffers of ``module`` that its forward writes, and copies of them."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._known: set[str] | None = None  # learned on the first recomputed forward

    def snapshot(self) -> tuple[Snapshot, dict[str, tuple[int, int]]]:
        """Copies of the buffers a forward may write, and every buffer's (identity, version)."""
        buffers = dict(self._module.named_buffers())
        marks = {name: (id(t), t._version) for name, t in buffers.items()}
        names = buffers if self._known is None else self._known
        return {name: buffers[name].clone() for name in names if name in buffers}, marks

    def learn(self, snapshot: Snapshot, marks: dict[str, tuple[int, int]]) -> Snapshot:
        """After the forward ``snapshot`` preceded: note what it wrote; keep only that."""
        written = {name for name, t in self._module.named_buffers()
                   if marks.get(name) != (id(t), t._version)}
        self._known = written if self._known is None else self._known | written
        return {name: value for name, value in snapshot.items() if name in self._known}

    @contextmanager
    def replayed(self, snapshot: Snapshot | None) -> Iterator[None]:
        """Within the body the buffers hold ``snapshot``; afterwards their live values."""
        if not snapshot:
            yield
            return
        live = []
        with torch.no_grad():
            for name, value in snapshot.items():
                owner, _, attribute = name.rpartition(".")
                module = self._module.get_submodule(owner)
                tensor = getattr(module, attribute)
                live.append((module, attribute, tensor, tensor.clone()))
                tensor.copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                for module, attribute, tensor, value in live:
                    setattr(module, attribute, tensor)
                    tensor.copy_(value)


GeneratorStates = list[torch.Tensor]


class OwnGenerators:
    """The ``torch.Generator`` objects held by ``module``'s submodules, and their states."""

    def __init__(self, module: nn.Module) -> None:
        found: dict[int, torch.Generator] = {}
        for submodule in module.modules():
            for value in vars(submodule).values():
                for candidate in _members(value):
                    if isinstance(candidate, torch.Generator):
                        found.setdefault(id(candidate), candidate)
        self._generators = list(found.values())

    def __bool__(self) -> bool:
        return bool(self._generators)

    def snapshot(self) -> GeneratorStates | None:
        """Their states now, or None when the module holds no generator."""
        return [g.get_state() for g in self._generators] if self._generators else None

    def rewind(self, states: GeneratorStates | None) -> None:
        """Set them back to ``states`` (a forward run again)."""
        for generator, state in zip(self._generators, states or []):
            generator.set_state(state)

    @contextmanager
    def replayed(self, states: GeneratorStates | None) -> Iterator[None]:
        """Within the body the generators hold ``states``; afterwards their live states."""
        if states is None:
            yield
            return
        live = self.snapshot()
        self.rewind(states)
        try:
            yield
        finally:
            self.rewind(live)


@dataclass(frozen=True)
class Replay:
    """What a recomputation puts back to see what its forward saw (besides the inputs)."""

    buffers: Snapshot
    generators: GeneratorStates | None  # the layers' own generators


@dataclass(frozen=True)
class Before:
    """The state as a forward that will be recomputed found it (``ForwardState.before``)."""

    buffers: Snapshot
    marks: dict[str, tuple[int, int]]
    generators: GeneratorStates | None


class ForwardState:
    """What a chunk's forwards change, for its recomputations: buffers and own generators."""

    def __init__(self, module: nn.Module) -> None:
        self.buffers = WrittenBuffers(module)
        self.generators = OwnGenerators(module)

    def before(self) -> Before:
        """Before the forward of a micro-batch that will be recomputed."""
        buffers, marks = self.buffers.snapshot()
        return Before(buffers, marks, self.generators.snapshot())

    def after(self, before: Before) -> Replay:
        """After that forward: what its recomputation puts back."""
        return Replay(self.buffers.learn(before.buffers, before.marks), before.generators)

    @contextmanager
    def replayed(self, replay: Replay | None) -> Iterator[None]:
        """Within the body, the state as ``replay``'s forward found it (none: as it is)."""
        if replay is None:
            yield
            return
        with self.buffers.replayed(replay.buffers), self.generators.replayed(replay.generators):
            yield


def _members(value: Any) -> tuple[Any, ...]:
    if isinstance(value, dict):
        return tuple(value.values())
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return (value,)
