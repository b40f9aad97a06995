"""The seeds that make recomputation exact: one per (layer, micro-batch) forward and step.

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

A run under a seed, and the check whether it drew, are part of a layer run's guards
(``pipeline.compute.layer_run``); this module says which numbers.
"""

from __future__ import annotations

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
