"""DualPipeV (DeepSeek): a V of two chunks per stage, forward and backward paired in the steady state.

DeepSeek-V3's DualPipe feeds micro-batches from both ends of a pipeline that holds
two copies of the model; Sea AI Lab's "cut-in-half" turns it into DualPipeV, one
copy in a V (stage s holds chunk s going down and chunk 2P-1-s coming back, as in
ZB-V), all micro-batches entering at stage 0. Its steady state pairs a forward of one
chunk with a full backward of the other (``F&B``), which DeepSeek's kernels overlap
(computation of one with communication of the other); the warm-up and cool-down
split backwards into I and W (zero bubble) where a W can fill a gap.

Stage s runs, in eight phases (``P`` stages, ``M >= 2P`` micro-batches):

1. ``2(P-1-s)`` forwards of the down chunk;
2. ``s+1`` times: F down, F up;
3. ``P-1-s`` times: I up, W (the oldest held back), F up;
4. ``M-2P+s+1`` times: F down, B up, F up, B down (two F&B pairs);
5. ``P-1-s`` times: B up, F up, B down;
6. ``s+1`` times: B up, B down, the last s+1 of these backwards split into I and W;
7. ``P-1-s`` times: W, I down;
8. ``s+1`` Ws; Ws always run oldest first.

Bubble. DeepSeek's README gives DualPipeV's bubble per stage as
``(PP/2-1)(F&B + B - 3W)`` with PP = 2P chunks, F, B, W the costs of one chunk's
forward, full backward (I + W) and weight gradient, and F&B that of an overlapped
pair. ``simulate`` neither overlaps a pair nor makes its forward wait for the
paired backward's gradient (DualPipeV receives both before computing either), so
here every stage idles exactly ``(P-1) max(F + I - W, F)`` per chunk when I <= F
(checked by the tests for P <= 8 and 2P <= M <= 4P): the README's formula with
F&B = F + W, i.e. a pair costing its forward and only the weight part of its
backward. With F&B = F + B (no overlap at all) the README's figure is larger by
(P-1) I; it is an approximation in that sense, and for I > F, where our idle grows
a little faster than linearly in P. With F = I = W = 1 per full stage (a chunk
costs half) it is (P-1)/2 time units per stage, ZB-V's ramp, with P+1/2
full-stage micro-batches held per stage (DeepSeek's "PP+1" counts chunks).
"""

from __future__ import annotations

from collections import deque

from schedules._checks import check_counts
from schedules.action import Action, Op, Schedule


def dualpipe_v(stages: int, microbatches: int, overlap: bool = False) -> Schedule:
    """DualPipeV: stage s holds chunks s and 2P-1-s; F&B pairs in the steady state.

    >>> print(dualpipe_v(stages=2, microbatches=4))  # doctest: +NORMALIZE_WHITESPACE
    stage 0: F0 F1 F2 F0@c3 I0@c3 W0@c3 F1@c3 F3 B1@c3 F2@c3 B0 B2@c3 F3@c3 B1
             B3@c3 I2 W2 I3 W3
    stage 1: F0@c1 F0@c2 F1@c1 F1@c2 F2@c1 B0@c2 F2@c2 B0@c1 F3@c1 B1@c2
             F3@c2 B1@c1 B2@c2 B2@c1 I3@c2 I3@c1 W3@c2 W3@c1

    Args:
        stages: number of pipeline stages P, >= 1.
        microbatches: number of micro-batches M, at least 2P.
        overlap: run the steady state's forward-and-backward neighbours as overlapped
            pairs (``Schedule.pairs``; ``schedules.pairs``): each F&B of phase 4 and the
            F up & B down of phase 5. The order is the same.

    Returns:
        The schedule, with ``placement[c] == min(c, 2P-1-c)``, named ``"dualpipe-v"``.

    Raises:
        ValueError: a count below one, or fewer than 2P micro-batches.
    """
    check_counts(stages, microbatches)
    if microbatches < 2 * stages:
        raise ValueError(
            f"dualpipe-v needs at least 2 x stages micro-batches: expected microbatches >= "
            f"{2 * stages} for stages={stages}, got microbatches={microbatches}; use more "
            f"micro-batches, or zb-v, which takes any count"
        )
    placement = tuple(min(chunk, 2 * stages - 1 - chunk) for chunk in range(2 * stages))
    builders = [_StageOrder(stages, stage) for stage in range(stages)]
    order = tuple(builder.build(microbatches) for builder in builders)
    pairs = tuple(tuple(builder.pairs) for builder in builders) if overlap else ()
    return Schedule(stages, microbatches, order, placement, name="dualpipe-v", pairs=pairs)


class _StageOrder:
    """One stage's list, built phase by phase; counts which micro-batch each op is at."""

    def __init__(self, stages: int, stage: int) -> None:
        self.stages, self.stage = stages, stage
        self.down, self.up = stage, 2 * stages - 1 - stage
        self.next = {(Op.F, self.down): 0, (Op.F, self.up): 0, (Op.B, self.down): 0,
                     (Op.B, self.up): 0}
        self.weights: deque[Action] = deque()
        self.order: list[Action] = []
        self.pairs: list[int] = []  # positions of the F of each F&B pair

    def pair(self) -> None:
        """The next two actions are a forward and a backward run as one pair."""
        self.pairs.append(len(self.order))

    def forward(self, chunk: int) -> None:
        self.order.append(Action(Op.F, self.next[(Op.F, chunk)], chunk))
        self.next[(Op.F, chunk)] += 1

    def backward(self, chunk: int, split: bool = False) -> None:
        microbatch = self.next[(Op.B, chunk)]
        self.next[(Op.B, chunk)] += 1
        self.order.append(Action(Op.I if split else Op.B, microbatch, chunk))
        if split:
            self.weights.append(Action(Op.W, microbatch, chunk))

    def weight(self) -> None:
        self.order.append(self.weights.popleft())

    def build(self, microbatches: int) -> tuple[Action, ...]:
        p, s, down, up = self.stages, self.stage, self.down, self.up
        for _ in range(2 * (p - 1 - s)):
            self.forward(down)
        for _ in range(s + 1):
            self.forward(down)
            self.forward(up)
        for _ in range(p - 1 - s):
            self.backward(up, split=True)
            self.weight()
            self.forward(up)
        for _ in range(microbatches - 2 * p + s + 1):
            self.pair()
            self.forward(down)
            self.backward(up)
            self.pair()
            self.forward(up)
            self.backward(down)
        for _ in range(p - 1 - s):
            self.backward(up)
            self.pair()
            self.forward(up)
            self.backward(down)
        for index in range(2 * (s + 1)):  # the later half of these backwards are split
            self.backward(up if index % 2 == 0 else down, split=index >= s + 1)
        for _ in range(p - 1 - s):
            self.weight()
            self.backward(down, split=True)
        while self.weights:
            self.weight()
        return tuple(self.order)
