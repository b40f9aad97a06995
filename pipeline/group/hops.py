"""The hop model: per pair of stages, what moving a result between them costs.

``pipeline.group.links`` measures it (a ping-pong across ranks, or between stage
threads), ``Ranks.hops`` asks for it once and keeps it, ``pipeline.predict.step``
charges it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from schedules import Link


@dataclass(frozen=True)
class HopModel:
    """Per pair of stages, a ``Link``; callable as ``Costs.comm``.

    Attributes:
        links: ``((source, destination, Link), ...)``, one entry per calibrated
            pair, in both directions.
        method: how the links were measured (for reports).
        senders: like ``links``, what a send costs the *sending* stage's own time
            (copying the payload into its message, the ``isend`` call, which under
            gloo writes the bytes when the receive is posted, and the yield after it):
            charged to the action whose result is sent, not to the hop. Empty where
            sends cost the sender nothing worth counting (threads of one process).
    """

    links: tuple[tuple[int, int, Link], ...] = ()
    method: str = "none"
    senders: tuple[tuple[int, int, Link], ...] = ()

    def send_seconds(self, source: int, destination: int, nbytes: float) -> float:
        """Seconds the sending stage spends sending ``nbytes`` (0 when not calibrated)."""
        for start, end, found in self.senders:
            if (start, end) == (source, destination):
                return found(source, destination, nbytes)
        return 0.0

    def link(self, source: int, destination: int) -> Link:
        """The link from ``source`` to ``destination``; a free one for a stage to itself.

        Raises:
            ValueError: a pair of different stages that was not calibrated.
        """
        if source == destination:
            return Link(0.0, math.inf)
        for start, end, found in self.links:
            if (start, end) == (source, destination):
                return found
        known = sorted({(s, d) for s, d, _ in self.links})
        raise ValueError(f"no calibrated link from stage {source} to stage {destination}; "
                         f"expected one of the calibrated pairs {known}")

    def __call__(self, source: int, destination: int, nbytes: float) -> float:
        """Seconds to move ``nbytes`` from stage ``source`` to stage ``destination``."""
        return self.link(source, destination)(source, destination, nbytes)
