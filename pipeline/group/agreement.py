"""A stage's replicas agree, within the timeout, whether every one of them finished its step.

FSDP2's all-gathers and reduce-scatters wait for the process group's own timeout (30
minutes under gloo), not a Pipe's: a replica that failed mid-step would leave the others
inside them until its process ended, then with a raw gloo error. So before the gradients
are reduced, every replica says whether its step succeeded, in one bounded all-reduce; a
replica whose step failed says so from its error path. Each rank joins exactly one such
exchange per step, so a failed step's exchange can never meet the next step's reduction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipeline.errors import PeerError
from pipeline.group.collectives import all_reduce, barrier


class ReplicaAgreement:
    """One exchange per step over a stage's replicas: did every step succeed?"""

    def __init__(self, group: dist.ProcessGroup, timeout: float, device: torch.device) -> None:
        self.group = group
        self.timeout = timeout
        self.device = device
        self.pending = False  # this step's exchange is still to come

    def start(self, meet: bool) -> None:
        """A step begins; with ``meet``, first wait (bounded) until every replica begins it,
        so that no collective without a bound of its own waits for a replica that never
        started.

        Raises:
            PeerError: a replica did not begin the step within the timeout.
        """
        self.pending = False
        if meet:
            barrier(self.group, self.timeout, "beginning a step with this stage's replicas")
        self.pending = True

    def succeeded(self) -> None:
        """This rank's step succeeded; return once every replica's did.

        Raises:
            PeerError: a replica's step failed (naming it), or a replica did not answer
                within the timeout.
        """
        failed = self._exchange(0)
        if failed:
            raise PeerError(
                f"rank {failed - 1}, a data-parallel replica of this stage, failed its step: "
                f"no replica reduced this step's gradients; they are as before the step",
                rank=failed - 1)

    def failed(self) -> None:
        """This rank's step failed: tell the replicas (if this step has not agreed yet)
        before they reduce. A replica that does not answer within the timeout is left to
        find out by itself: the caller raises its own error either way."""
        if not self.pending:
            return
        try:
            self._exchange(dist.get_rank() + 1)
        except PeerError:
            pass

    def _exchange(self, flag: int) -> int:
        """The largest flag of every replica: 0 where every step succeeded, else one failed
        replica's global rank + 1."""
        self.pending = False
        value = torch.tensor([flag], dtype=torch.int64, device=self.device)
        all_reduce(value, self.group, self.timeout, "agreeing with this stage's replicas that "
                   "every replica's step succeeded", op=dist.ReduceOp.MAX)
        return int(value[0])
