"""One run of a chunk's layers made exact by one context, entered once a run (``LayerRuns.exact``).

A run is one forward of a chunk's layers on one micro-batch: with a graph, without one
(a recomputed micro-batch's first forward, inference), or the recomputation itself. The
context puts three guards around it, and learns across runs what they need to know:

**Inputs a write could harm run on copies.** A layer may write its input in place (an
in-place ReLU first in a stage, ``if h.isnan().any(): h.nan_to_num_()``), and a chunk's
inputs are the caller's ``x`` (or views of it), the tensors a sender still holds, and what
a recomputation starts from. Whether a layer writes may depend on the data (only the
micro-batches with a NaN), so it is settled for every run, not learned from the first
micro-batch. A tensor input runs as it is only where a write harms nobody or torch itself
refuses it before making it. The first chunk's forwards that build the graph run on
copies of the caller's ``x`` that the chunk keeps in place of the views it held
(``owned_copy``, then ``owned``: the plain model would write ``x``; a pipeline never
does), used by nothing after them. Inputs that require grad, in a forward that builds the graph (a later chunk's
differentiable ones, or ``x`` when it requires grad), are leaves of the chunk's own: torch
refuses a write to them. Every other input runs on a copy: non-differentiable ones
(masks, indices), and all of them in a forward without grad, where the copy lives only as
long as the forward. When torch refuses a write to an input that runs as it is, nothing
has been written: the context ends quietly with ``refused`` set, the layers' own
generators put back, and the chunk runs again on copies (``owned`` false), as it does
from then on. After
each run, the version counters of the copies tell whether the layers wrote them; a chunk
whose layers did copies everything from then on.

**The run's random numbers come from seeds of its own** (``pipeline.compute.recompute``
says which and why). The whole run holds the chunk's seed for the micro-batch, so that the
layers without a seed of their own draw what the recomputation draws again; in a step's
first run every layer runs under its own seed too (``LayerRun.layer``) and each one's
drawing is noted, and once none draws, later runs call the layers plainly. Whether a layer
without its own seed drew is checked on every run; where one did, every layer is seeded
from the next step on (``surprised``). With threads, the chunk holds its device's
generator lock around the context.

**The layers' own generators** (``forward_state.OwnGenerators``) are read before a run and
put back when torch refuses a write, so that the run again draws what the first did.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.compute.forward_state import OwnGenerators
from pipeline.compute.recompute import chunk_seed, layer_seed
from pipeline.errors import StageError
from pipeline.payloads.tree import Flat

# torch's words when an in-place op meets a leaf (or a view of one) that requires grad.
_REFUSALS = (
    "a leaf Variable that requires grad is being used in an in-place operation",
    "a view of a leaf Variable that requires grad is being used in an in-place operation",
)


@dataclass
class LayerRun:
    """One run: what the layers get, and how it ended.

    Attributes:
        inputs: the value the layers get (copies where a write could harm).
        quiet: no layer draws random numbers (known this step): call the layers plainly.
        refused: torch refused a write to an input before making it: run again, on copies.
    """

    inputs: Any
    quiet: bool
    runs: LayerRuns
    microbatch: int
    copies: tuple[torch.Tensor, ...] = ()
    as_is: tuple[torch.Tensor, ...] = ()
    versions: tuple[int, ...] = ()  # of ``as_is``, before the run
    refused: bool = False

    def layer(self, offset: int, layer: nn.Module, value: Any) -> Any:
        """``layer(value)``, the ``offset``-th of the chunk, under its own seed unless it is
        known to draw nothing (notes whether it drew, the first time)."""
        runs = self.runs
        draws = runs.draws[offset]
        if draws is False:
            return layer(value)
        seed = layer_seed(runs.seed_base, runs.first_layer + offset, self.microbatch)
        with seeded(runs.device, seed, watch=draws is None) as probe:
            value = layer(value)
            if draws is None:
                runs.draws[offset] = probe.drew()
        return value


class LayerRuns:
    """A chunk's runs: what their guards learn across runs and what they hold (the module)."""

    def __init__(self, layers: int, device: torch.device, first_layer: int,
                 generators: OwnGenerators) -> None:
        self.device = device
        self.first_layer = first_layer
        self.writes = False  # the layers wrote an input once: copy every input from now on
        self.seed_base = 0
        self.draws: list[bool | None] = [None] * layers  # per layer: does it draw?
        self.quiet = False  # no layer of the chunk draws random numbers (known this step)
        self.surprised = False  # an unseeded layer drew: seed every layer from the next step
        self._generators = generators
        self._holds_generators = bool(generators)

    def begin_step(self, seed_base: int) -> None:
        """This step's seeds: what drew in the last step is found again."""
        self.seed_base = seed_base
        self.draws = [True if self.surprised else None] * len(self.draws)
        self.quiet = False

    @contextmanager
    def exact(self, microbatch: int, inputs: Flat, owned: bool = False) -> Iterator[LayerRun]:
        """Around one run of the layers on ``inputs`` (``owned``: the chunk's own copies,
        which the layers may write; see the module)."""
        generators = self._generators.snapshot() if self._holds_generators else None
        run = self._prepared(microbatch, inputs, owned)
        watched = False in self.draws  # else every layer runs under its own seed
        try:
            with seeded(self.device, chunk_seed(self.seed_base, self.first_layer, microbatch),
                        watch=watched) as probe:
                yield run
                if watched and probe.drew():
                    self.surprised = True
        except StageError as error:
            if not self._refused(error.__cause__, run):
                raise
            self._generators.rewind(generators)
            run.refused = True
            return
        if not run.quiet:
            self.quiet = not any(self.draws)
        self._check(run)

    def _prepared(self, microbatch: int, inputs: Flat, owned: bool) -> LayerRun:
        """The leaves for one run: copies, except those torch guards itself (and, if
        ``owned``, those that need no grad: the chunk's own copies, last used here)."""
        guarded = torch.is_grad_enabled() and not self.writes
        leaves: list[object] = []
        copies: list[torch.Tensor] = []
        as_is: list[torch.Tensor] = []
        for leaf in inputs.leaves:
            if isinstance(leaf, torch.Tensor):
                if guarded and leaf.requires_grad and leaf.is_leaf:
                    as_is.append(leaf)
                elif leaf.requires_grad or not owned:
                    leaf = leaf.clone()
                    copies.append(leaf)
            leaves.append(leaf)
        return LayerRun(inputs.rebuild(leaves), self.quiet, self, microbatch, tuple(copies),
                        tuple(as_is), tuple(t._version for t in as_is))

    def _refused(self, error: BaseException | None, run: LayerRun) -> bool:
        """Whether ``error`` is torch refusing a write to an input given as it is; if so,
        nothing was written, and every input is a copy from now on."""
        if not run.as_is or not isinstance(error, RuntimeError):
            return False
        if not any(refusal in str(error) for refusal in _REFUSALS):
            return False  # a parameter, say: the plain model fails the same way
        self.writes = True
        return True

    def _check(self, run: LayerRun) -> None:
        """After a run: note whether its layers wrote an input (a copy)."""
        if self.writes:
            return
        # Inference tensors (a copy made under inference_mode) keep no version counter,
        # and what they are copies of was left untouched anyway.
        wrote = any(t._version for t in run.copies if not t.is_inference())
        # A write torch let through (under an inner no_grad) reached an input as the
        # plain model's would reach it; the next runs use copies.
        wrote = wrote or any(t._version != v for t, v in zip(run.as_is, run.versions))
        self.writes = wrote


class Probe:
    """Tells whether the body of a ``seeded`` block drew from the device's generator."""

    def __init__(self, device: torch.device, watch: bool) -> None:
        self.device = device
        self._before = _generator_state(device) if watch else None

    def drew(self) -> bool:
        if self._before is None:
            return True
        return not torch.equal(self._before, _generator_state(self.device))


def _generator_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


@contextmanager
def seeded(device: torch.device, seed: int, watch: bool = False) -> Iterator[Probe]:
    """Run the body under ``seed`` on ``device``'s generator, restoring it afterwards.

    The caller holds the generator's lock, if it has one. With ``watch``, the yielded
    Probe tells afterwards whether the body drew numbers.
    """
    if device.type == "cuda":
        with torch.random.fork_rng(devices=[device]):
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
            yield Probe(device, watch)
        return
    # On the CPU, what fork_rng saves and restores there, without its accelerator and
    # device-module lookups (with chunk.py's untouched None target: a forward 0.71-0.84 ->
    # 0.65-0.77 ms of CPU after a 25 ms sleep, caches cold as between a pipeline's actions).
    generator = torch.default_generator
    state = generator.get_state()
    generator.manual_seed(seed)
    try:
        yield Probe(device, watch)
    finally:
        generator.set_state(state)


def owned_copy(inputs: Flat) -> Flat:
    """``inputs`` with copies of the tensors that need no grad (those that do are leaves of
    their own already, which torch guards): the chunk's own, which its layers may write."""
    return Flat(tuple(
        leaf.clone() if isinstance(leaf, torch.Tensor) and not leaf.requires_grad else leaf
        for leaf in inputs.leaves
    ), inputs.spec)
