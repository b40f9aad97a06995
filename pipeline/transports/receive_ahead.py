"""Receives posted ahead under gloo: the shape predictions that size them, and their budget.

Why receives are posted ahead, under gloo: a gloo send whose receive is not yet
posted only announces itself; the bytes leave when the sender's gloo thread
hears that the receive is ready. Were a receive posted only once its data was
needed, every hop would wait for that thread to be scheduled on a core busy
with the sender's next action: about a millisecond per hop, and in 1F1B every
hop is on the critical path. But a receive needs its size, and the size comes
with the message. So both ends remember, per message, the shapes it carried in
the previous step; the receiver posts a few messages ahead with the predicted
size, and the sender, making the same prediction, sends exactly that size (a stage posts them
from its first wait on, in time it would idle anyway):

- shapes as predicted: the whole message, in one send;
- shapes changed, or nothing predicted (the first step, or shapes that changed
  in the step before): a message of the size the receiver expects (the predicted
  size, or a bare header when nothing is predicted) carrying only the header,
  with status "next", then the whole message under a second tag, which the
  receiver posts once the header has told it the size.

A message whose shapes just changed is not predicted in the next step, so shapes
that vary from step to step cost one extra small message per hop, never a wrong
read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from schedules.dependencies import ActionKey

from pipeline.transports.wire import HEADER_BYTES, Metas, message_size

PAYLOAD_LOOKAHEAD = 4  # receives posted ahead of use, under gloo, at least
AHEAD_BYTES = 8 << 20  # and more while their buffers stay within this many bytes

# (key, peer stage) -> (the shapes it last carried, whether they were the same as before)
Record = dict[tuple[ActionKey, int], tuple[Metas, bool]]
Posted = tuple[torch.Tensor, Any]  # a posted receive's buffer and its gloo work


def remember(record: Record, key: tuple[ActionKey, int], metas: Metas) -> None:
    previous = record.get(key)
    record[key] = (metas, previous is None or previous[0] == metas)


def predicted(record: Record, key: tuple[ActionKey, int]) -> Metas | None:
    last = record.get(key)
    return last[0] if last is not None and last[1] else None


def expected_size(metas: Metas | None) -> int:
    """The size of the first message the receiver posts for: the predicted message, or a
    bare header when nothing is predicted."""
    return HEADER_BYTES if metas is None else message_size(metas)


class ReceivesAhead:
    """One step's receives still to post ahead, in the order of use, and those posted."""

    def __init__(self) -> None:
        self.pending: list[tuple[ActionKey, int]] = []  # (key, source stage)
        self.posted: dict[ActionKey, Posted] = {}
        self.posted_bytes = 0

    def start_step(self, receives: Sequence[tuple[ActionKey, int]]) -> None:
        self.pending = list(receives)
        self.posted = {}
        self.posted_bytes = 0

    def post(self, post: Callable[[ActionKey, int, int], Posted],
             size_of: Callable[[ActionKey, int], int], lookahead: int, budget: int) -> None:
        """``post`` the pending receives: ``lookahead`` of them at least, more while the
        posted buffers stay within ``budget`` bytes."""
        while self.pending:
            key, source = self.pending[0]
            size = size_of(key, source)
            if len(self.posted) >= lookahead and self.posted_bytes + size > budget:
                return
            self.pending.pop(0)
            self.posted[key] = post(key, source, size)
            self.posted_bytes += size

    def claim(self, key: ActionKey) -> Posted | None:
        """The receive posted for ``key``, if any; otherwise ``key`` is no longer pending."""
        posted = self.posted.pop(key, None)
        if posted is not None:
            self.posted_bytes -= posted[0].numel()
        elif self.pending and self.pending[0][0] == key:
            self.pending.pop(0)
        else:
            self.pending = [entry for entry in self.pending if entry[0] != key]
        return posted

    def drop_posted(self) -> None:
        self.posted, self.posted_bytes = {}, 0
