"""What expert parallelism does to a plan's units: a share of their experts held, and the token exchanges.

The planner profiles each unit whole, in one process, its experts run as written. With
each stage's experts spread over ``size`` ranks (a mesh's ``"ep"`` dimension), a rank
still computes as many (token, pick) rows as its own rows pick, on balanced routing: the
unit's work is as measured. It holds ``1 - experts + experts / size`` of its parameter
bytes (``experts``: the share of its parameter bytes in experts modules). Each experts
module costs two all-to-alls forward (the tokens to their experts' ranks, the outputs
back) and two backward (their gradients, reversed), each of ``picks`` rows of the unit's
output width, of which a rank sends ``(size - 1) / size``: ``size - 1`` messages over the
``ep`` hop (``exchange_seconds``). The I of a split backward pays the backward's; W pays
none (an expert's weight gradient is a local product).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from partitioners.measure.cost import LayerCost, Profile
from schedules import Link


@dataclass(frozen=True)
class ExpertParallelism:
    """How each stage's ep ranks share its experts.

    Attributes:
        size: ranks per stage (the mesh's ``"ep"``); 1: no expert parallelism.
        experts: per unit, the share of its parameter bytes in experts modules (0 to 1).
        exchanges: per unit, its experts modules: two all-to-alls forward and two backward
            each.
        picks: per unit, the experts each token picks (its rows in an exchange per row of
            the unit's output).
        link: the hop between two ep ranks.

    Raises:
        ValueError: ``size`` below 1, a share outside [0, 1], a negative count, or
            per-unit tuples of different lengths.
    """

    size: int
    experts: tuple[float, ...]
    exchanges: tuple[int, ...]
    picks: tuple[int, ...]
    link: Link

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"ExpertParallelism.size: expected an int >= 1, got {self.size!r}")
        if not len(self.experts) == len(self.exchanges) == len(self.picks):
            raise ValueError(f"ExpertParallelism: {len(self.experts)} shares, "
                             f"{len(self.exchanges)} exchange counts and {len(self.picks)} "
                             f"pick counts: expected one of each per unit")
        if any(not 0.0 <= share <= 1.0 for share in self.experts) or \
                any(count < 0 for count in (*self.exchanges, *self.picks)):
            raise ValueError(f"ExpertParallelism: expected shares in [0, 1] and counts >= 0, "
                             f"got {self.experts}, {self.exchanges} and {self.picks}")

    def exchange_seconds(self, nbytes: float) -> float:
        """One all-to-all of ``nbytes`` of rows from a rank: ``size - 1`` messages, each
        of ``nbytes / size``, one after another over the hop (0 with one rank)."""
        if self.size < 2 or nbytes <= 0:
            return 0.0
        return (self.size - 1) * (self.link.latency + nbytes / self.size / self.link.bandwidth)


def spread_costs(costs: Sequence[LayerCost], expert_parallel: ExpertParallelism
                 ) -> list[LayerCost] | Profile:
    """``costs`` (one unit each, measured whole) as one ep rank runs them.

    Raises:
        ValueError: costs for another number of units than ``expert_parallel`` describes.
    """
    if len(costs) != len(expert_parallel.experts):
        raise ValueError(f"expert parallelism describes {len(expert_parallel.experts)} units, "
                         f"the profile has {len(costs)}")
    size = expert_parallel.size
    found = []
    for cost, experts, exchanges, picks in zip(costs, expert_parallel.experts,
                                               expert_parallel.exchanges, expert_parallel.picks):
        held = 1.0 - experts + experts / size
        exchange = 2 * exchanges * expert_parallel.exchange_seconds(cost.activation_bytes * picks)
        found.append(replace(
            cost, forward=cost.forward + exchange, backward=cost.backward + exchange,
            exchange=cost.exchange + exchange,
            backward_input=cost.backward_input + exchange if cost.backward_input else 0.0,
            param_bytes=round(cost.param_bytes * held),
            weight_bytes=None if cost.weight_bytes is None else round(cost.weight_bytes * held)))
    if isinstance(costs, Profile):
        return Profile(found, costs.loss, costs.microbatch_size, costs.device)
    return found
