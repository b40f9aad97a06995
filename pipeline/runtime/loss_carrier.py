"""The batch loss, carried to every stage inside a step's backward messages, with no collective."""

from __future__ import annotations

from typing import Any

import torch


class LossCarrier:
    """The batch loss, carried to every stage inside the backward messages.

    Each backward message gets one more tensor, ``[count, sum]`` in float64: how many
    micro-batches' losses its sender knows of, and their sum in the order the last chunk
    computed them. A stage keeps the row with the larger count. Every stage ends a step
    knowing the whole sum, with no collective: the micro-batch whose loss came last has its
    backward run through every chunk after that loss, each chunk's rank learning the sum
    before it sends on. The last stage's own row and every other stage's final row are then
    the same tensor's value, so every rank returns the same loss, bit for bit.
    """

    __slots__ = ("device", "known", "count")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Never written once made: a backward message carries it as it is (the transports
        # copy it, a receiving carrier clones it), where a clone for each message and a
        # torch.where on each arrival cost a backward hop 4 tensor ops (0.19 -> 0.12 ms of CPU,
        # both ends, after a 25 ms sleep, caches cold as between a pipeline's actions).
        self.known: torch.Tensor | None = None
        self.count = 0.0  # known[0], as a number

    def add(self, loss: torch.Tensor) -> None:
        """A loss this stage computed (the last chunk's forward)."""
        known = self.known
        row = torch.zeros(2, dtype=torch.float64, device=self.device) if known is None \
            else known.clone()
        row[0] += 1
        row[1] += loss.detach().to(row.device, torch.float64).reshape(())
        self.known, self.count = row, self.count + 1

    def attach(self, grads: tuple[Any, ...]) -> tuple[Any, ...]:
        """``grads`` with what this stage knows of the loss, for a backward message."""
        if self.known is None:
            self.known = torch.zeros(2, dtype=torch.float64, device=self.device)
        return (*grads, self.known)

    def detach(self, payload: Any) -> Any:
        """The gradients of a backward message; its loss row merged into what is known."""
        *grads, row = payload
        known = self.known
        if row.device.type != "cpu":  # compared where it lies: reading it would sync
            # A copy, not the row itself: that is a view of a pooled receive buffer.
            self.known = row.clone() if known is None else torch.where(row[0] > known[0], row, known)
            return tuple(grads)
        count = row.tolist()[0]
        if known is None or count > self.count:
            self.known, self.count = row.clone(), count
        return tuple(grads)
