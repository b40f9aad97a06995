"""Can layers be cut into stages each under a bound? Exact reachable-cut sets on integers.

Why it is built this way
------------------------
Cutting ``n`` layers into ``P`` contiguous, non-empty stages is a walk over cut
positions ``0 = c_0 < c_1 < ... < c_P = n``. For a bound ``B`` on stage time,
``reachable[s]`` is the set of positions ``c_{s+1}`` that stages ``0..s`` can end at,
every stage within ``B`` and within its memory cap. The whole question is then
"is ``n`` in ``reachable[P-1]``", and a cut is read back by walking down from ``n``.

Two facts keep this exact and fast:

- A stage that fits still fits when it starts later (same end): its time and its
  memory only shrink. So position ``b`` is reachable iff the largest reachable
  position below ``b`` can start a stage ending at ``b``; no other start needs a look.
- Without send costs, a stage that fits also fits when it ends earlier. If, in
  addition, a layer that fits alone in stage ``s`` also fits alone in every later
  stage (true when the micro-batches held per stage never grow along the pipeline,
  as under GPipe and 1F1B), the reachable set after each stage is one interval,
  and stepping it costs one bisection: the greedy "go as far as the bound allows",
  made exact for an exact number of non-empty stages. Otherwise (send costs, or
  memory caps that grow along the pipeline) each stage's step scans the positions
  in its window, still exact.

Windows come from a relaxation (time only, no send cost, no memory): the furthest
a greedy walk from the left can get after ``s+1`` stages and the nearest a walk from
the right needs to start. They only drop positions that cannot lead to a full cut,
and near the optimal bound they are narrow, which keeps the scans short.

All costs are integers (the caller scales exact fractions), so comparisons are
exact and no epsilon can make an answer non-optimal.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from functools import cached_property

from partitioners.cut.intervals import Intervals, clip, merge, predecessor


Copies = tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]


def copied_bytes(copies: Copies, start: int, end: int) -> int:
    """Of ``copies`` (see ``MemoryCap.copies``), the bytes a stage of layers ``start..end-1``
    holds: per earlier layer some of its users use, the most any of them uses."""
    total = 0
    for origin, users, used in copies:
        if origin < start:
            first, last = bisect_left(users, start), bisect_left(users, end)
            total += max(used[first:last], default=0)
    return total


@dataclass(frozen=True)
class MemoryCap:
    """Stage memory ``fixed + held[stage] * saved`` over its layers, plus
    ``held_inputs[stage] * inputs[first layer]``, capped at ``limit``.

    Attributes:
        fixed: prefix sums of per-layer bytes that do not scale with micro-batches.
        saved: prefix sums of per-layer bytes saved per micro-batch.
        held: per stage, how many micro-batches' saved bytes it holds at once.
        limit: the cap, in the same (scaled) units.
        inputs: per layer, the bytes a stage starting there keeps per micro-batch whose
            activations are recomputed (its input, or a bound of it); non-increasing, so
            that a stage starting later never needs more; empty: none.
        held_inputs: per stage, how many micro-batches' inputs it holds beside them.
        copies: per earlier layer whose parameters later layers use (a head tied to the
            embedding), ``(that layer, the layers using them in order, the bytes each
            uses)``: a stage holding some of those layers but not the first holds a copy
            of the most any of them uses. A stage that starts later still never needs
            more: the copy it may gain is part of the first layer's parameters it loses.
    """

    fixed: tuple[int, ...]
    saved: tuple[int, ...]
    held: tuple[int, ...]
    limit: int
    inputs: tuple[int, ...] = ()
    held_inputs: tuple[int, ...] = ()
    copies: Copies = ()

    def copied(self, start: int, end: int) -> int:
        """Bytes of the copies of earlier layers' parameters that layers ``start..end-1`` hold."""
        return copied_bytes(self.copies, start, end)

    def _kept_inputs(self, start: int, stage: int) -> int:
        return self.held_inputs[stage] * self.inputs[start] if self.held_inputs else 0

    def stage(self, start: int, end: int, stage: int) -> int:
        """Memory of a stage ``stage`` holding layers ``start..end-1``."""
        saved = self.saved[end] - self.saved[start]
        return (self.fixed[end] - self.fixed[start] + self.held[stage] * saved
                + self._kept_inputs(start, stage) + self.copied(start, end))

    def reach(self, start: int, stage: int, end_at_most: int) -> int:
        """The furthest end, up to ``end_at_most``, of a stage from ``start`` under the cap."""
        if self.copies:
            return bisect_right(range(end_at_most + 1), self.limit, lo=start,
                                key=lambda end: self.stage(start, end, stage)) - 1
        fixed, saved, held = self.fixed, self.saved, self.held[stage]
        threshold = (self.limit + fixed[start] + held * saved[start]
                     - self._kept_inputs(start, stage))
        def memory_to(end: int) -> int:
            return fixed[end] + held * saved[end]

        return bisect_right(range(end_at_most + 1), threshold, lo=start, key=memory_to) - 1

    @cached_property
    def nested(self) -> bool:
        """Whether later stages hold no more micro-batches than earlier ones, and no stage's
        memory depends on where it starts (kept inputs do)."""
        return (all(a >= b for a, b in zip(self.held, self.held[1:]))
                and not any(self.held_inputs))


@dataclass(frozen=True)
class Problem:
    """Layers with integer costs, to be cut into ``stages`` contiguous non-empty stages.

    Attributes:
        prefix: prefix sums of layer costs; ``prefix[b] - prefix[a]`` is layers a..b-1.
        stages: number of stages.
        send: per layer, a cost added to a stage (other than the last) that ends with
            it, e.g. the time to send its activation; empty for none.
        memory: an optional per-stage memory cap.
    """

    prefix: tuple[int, ...]
    stages: int
    send: tuple[int, ...] = ()
    memory: MemoryCap | None = None

    @property
    def layers(self) -> int:
        return len(self.prefix) - 1

    @cached_property
    def greedy_exact(self) -> bool:
        """Whether each step is an interval (see the module docstring)."""
        return not self.send and (self.memory is None or self.memory.nested)

    def time(self, start: int, end: int, stage: int) -> int:
        """Cost of stage ``stage`` holding layers ``start..end-1``, send cost included."""
        cost = self.prefix[end] - self.prefix[start]
        if self.send and stage < self.stages - 1:
            cost += self.send[end - 1]
        return cost

    def fits(self, start: int, end: int, stage: int, bound: int) -> bool:
        """Whether that stage is non-empty, within ``bound`` and under the memory cap."""
        if end <= start or self.time(start, end, stage) > bound:
            return False
        return self.memory is None or self.memory.stage(start, end, stage) <= self.memory.limit

    def reach(self, start: int, stage: int, bound: int) -> int:
        """The furthest end of a stage from ``start`` within ``bound`` (no send cost)."""
        prefix = self.prefix
        end = bisect_right(prefix, prefix[start] + bound, lo=start) - 1
        if self.memory is not None:
            end = self.memory.reach(start, stage, end)
        return end


def windows(problem: Problem, bound: int) -> list[tuple[int, int]]:
    """Per stage, the interval its end can lie in: necessary, from a time-only relaxation."""
    prefix, n, stages = problem.prefix, problem.layers, problem.stages
    highs = []
    position = 0
    for stage in range(stages):
        position = bisect_right(prefix, prefix[position] + bound, lo=position) - 1
        position = min(position, n - (stages - 1 - stage))
        highs.append(position)
    lows = [0] * stages
    position = n
    for stage in range(stages - 1, -1, -1):
        position = max(position, stage + 1)
        lows[stage] = position
        position = bisect_left(prefix, prefix[position] - bound, hi=position)
    return list(zip(lows, highs))


def step(
    problem: Problem, starts: Intervals, stage: int, bound: int, window: tuple[int, int]
) -> Intervals:
    """The ends, within ``window``, of stage ``stage`` started at a position in ``starts``.

    The greedy form (one bisection per interval) needs every layer inside ``starts``
    (but the last position of each interval) to fit alone in this stage under
    ``bound``; callers keep to that by clipping (see ``minmax``).
    """
    low, high = window
    if not starts or low > high:
        return []
    if problem.greedy_exact:
        pieces = [(first + 1, problem.reach(last, stage, bound)) for first, last in starts]
        return clip(merge(pieces), low, high)
    return _scan(problem, starts, stage, bound, low, high)


def _scan(
    problem: Problem, starts: Intervals, stage: int, bound: int, low: int, high: int
) -> Intervals:
    prefix = problem.prefix
    send = problem.send if stage < problem.stages - 1 else ()
    memory = problem.memory
    first = max(low, starts[0][0] + 1)
    last = min(high, bisect_right(prefix, prefix[starts[-1][1]] + bound) - 1)
    found: Intervals = []
    run = -1
    index, count = 0, len(starts)
    for end in range(first, last + 1):
        while index + 1 < count and starts[index + 1][0] < end:
            index += 1
        start = min(starts[index][1], end - 1)
        cost = prefix[end] - prefix[start] + (send[end - 1] if send else 0)
        ok = cost <= bound and (memory is None or memory.stage(start, end, stage) <= memory.limit)
        if ok and run < 0:
            run = end
        elif not ok and run >= 0:
            found.append((run, end - 1))
            run = -1
    if run >= 0:
        found.append((run, last))
    return found


def reachable(problem: Problem, bound: int) -> list[Intervals] | None:
    """Per stage s, the positions stages ``0..s`` can end at within ``bound``; None if none."""
    spans = windows(problem, bound)
    sets = []
    current: Intervals = [(0, 0)]
    for stage in range(problem.stages):
        current = step(problem, current, stage, bound, spans[stage])
        if not current:
            return None
        sets.append(current)
    return sets  # the last window is [n, n], so a non-empty last set holds n


def cut_from(problem: Problem, sets: list[Intervals], bound: int) -> list[int]:
    """Read a cut back from ``reachable``'s sets: layers per stage."""
    ends = [problem.layers]
    for stage in range(problem.stages - 1, 0, -1):
        start = predecessor(sets[stage - 1], ends[-1])
        if start is None or not problem.fits(start, ends[-1], stage, bound):
            raise RuntimeError(f"no start for stage {stage} ending at {ends[-1]}: a bug")
        ends.append(start)
    ends.append(0)
    ends.reverse()
    return [b - a for a, b in zip(ends, ends[1:])]
