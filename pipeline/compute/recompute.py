"""The per-layer RNG streams that make recomputation exact (the modes: ``schedules.checkpointing``).

Why it is built this way: a stage that recomputes a forward right before its
backward must see the very same random numbers (dropout masks, stochastic
depth, ``torch.bernoulli`` in a custom block) that the first forward saw, or
the gradients belong to a different network. Saving and restoring the global
RNG state around each forward is not enough when several stages run as
threads in one process: they share the CPU generator (and a GPU generator per
device), so the state a forward sees would depend on thread timing. And a
stream per model chunk would make the numbers depend on where the model was
cut, so two schedules would train two different networks.

The contract: at the start of a step one number is drawn from the caller's
generator; every (layer, micro-batch) forward that draws random numbers runs
under its own seed derived from that number, the layer's index in the model
and the micro-batch's index, on the generator of the layer's device. The
recomputation reuses that seed. For one global seed the numbers therefore
depend neither on the schedule, the cut, the checkpoint mode nor on thread
timing, and the same seed gives the same step twice (the unpipelined model,
which draws from one stream, sees other numbers).

Which layers draw is not declared: the first micro-batch of each step runs
every layer under its seed and checks whether the generator moved. Layers that
drew keep their seed for the rest of the step; layers that did not run plainly.

A layer may draw only for some inputs (rows over a threshold, a short
micro-batch), so not drawing in the first micro-batch proves nothing. So a
chunk's whole forward runs under a seed of its own too (from the chunk's first
layer and the micro-batch), the layers without a seed drawing from that
stream, and the recomputation runs under the same one: exact, whoever draws,
for the price of one state save and restore per forward (what
``torch.utils.checkpoint`` pays per call). Whether such a layer drew is checked
on every forward (the generator's state against the freshly seeded one); a
chunk where one did seeds every layer from its next step on, so that the
numbers stop depending on where the model was cut.

With threads, stages on one device share its generator: a chunk's forward runs
holding the device's lock, so no draw, seeded or not, takes numbers meant for
another stage's layer (backwards, the larger part of a step, still overlap).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def step_seed() -> int:
    """One number drawn from the default generator: the base of a step's seeds."""
    return int(torch.randint(0, 2**62, (1,)).item())


def layer_seed(base: int, layer: int, microbatch: int) -> int:
    """The seed of one (layer, micro-batch) forward within a step."""
    return (base * 1_000_003 + layer * 10_007 + microbatch) % (2**63 - 1)


def chunk_seed(base: int, first_layer: int, microbatch: int) -> int:
    """The seed of one (chunk, micro-batch) forward, for the layers that run without theirs."""
    return layer_seed(base ^ 0x5EED_C4A0_0C4E_5EED, first_layer, microbatch)


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
