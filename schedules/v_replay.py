"""The replay under a memory cap that turns V-Half's and V-Min's critical lists into stage orders.

``schedules.v_shape`` builds each stage's critical list (its Fs and Is in block-time
order) and asks a few replays of it for the shortest; this module runs one replay: unit
costs, Ws inserted as input gradients free them, never past the cap (see
``v_shape``'s docstring for the rules and why they cannot deadlock with room).
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque

from schedules._speed import OP_F, OP_I, OP_W
from schedules.action import Action, Schedule
from schedules.dependencies import dependency_keys


class Stalled(Exception):
    """Every stage waits: a replay without room filled a stage with forwards down."""


class ReplayPlan:
    """The critical lists, each action numbered and its dependencies read once for every replay.

    Numbers run through stage 0's list, then stage 1's, and so on, so within a stage a
    smaller number comes earlier in the list. A replay counts each action's unfinished
    dependencies down as they run (``waiters`` says whose to count), so that asking
    whether an action is ready, millions of times at larger P and M, reads one number.
    """

    def __init__(self, critical: Schedule) -> None:
        self.stages = critical.stages
        self.actions = [action for actions in critical.order for action in actions]
        number = {(action.op, action.microbatch, action.chunk): index
                  for index, action in enumerate(self.actions)}
        self.lists: list[range] = []  # each stage's numbers, in list order
        self.stage_of: list[int] = []
        self.kinds: list[int] = []  # _I, _F_UP or _F_DOWN: what the action asks of memory
        self.waiting: list[int] = []  # how many dependencies each waits for at the start
        self.waiters: list[list[int]] = [[] for _ in self.actions]
        for stage, actions in enumerate(critical.order):
            first = len(self.stage_of)
            self.lists.append(range(first, first + len(actions)))
            for index, action in enumerate(actions, start=first):
                needs = dependency_keys(critical, action.op, action.microbatch, action.chunk)
                self.stage_of.append(stage)
                self.kinds.append(_kind(action, stage))
                self.waiting.append(len(needs))  # a need no list holds is never finished
                for key in needs:
                    if key in number:
                        self.waiters[number[key]].append(index)


_I, _F_UP, _F_DOWN = 0, 1, 2


def _kind(action: Action, stage: int) -> int:
    """What ``action`` asks of ``stage``'s memory (``CappedReplay.need``: how many slots)."""
    if action.op is not OP_F:
        return _I
    return _F_DOWN if action.chunk == stage else _F_UP


class CappedReplay:
    """Replay critical lists with unit costs, inserting Ws, never past ``cap`` activations.

    Beside each stage's list of numbers, its ready actions wait in three heaps, one per
    kind (``_kind``), smallest number first: the first ready action that fits, the way
    out when every stage would wait, is then the smallest of at most three heads, not a
    scan of the whole list (v_min(32, 128): 4.0 -> 1.4 s of CPU; the P = 32 plan of
    benchmarks/bench_planner.py: 14.8 -> 8.3 s). An action taken from the list stays in its
    heap, marked taken, until it comes to the top.
    """

    def __init__(self, plan: ReplayPlan, cap: int, window: int, room: bool) -> None:
        self.stages = plan.stages
        self.plan = plan
        self.cap = cap
        self.window = window
        self.need = (0, 1, 2 if room else 1)  # activation slots by kind: I, F up, F down
        self.lists = [list(numbers) for numbers in plan.lists]
        self.waiting = list(plan.waiting)
        self.taken = bytearray(len(plan.actions))
        self.ready: list[tuple[list[int], ...]] = [([], [], []) for _ in range(plan.stages)]
        for number, waiting in enumerate(self.waiting):
            if not waiting:  # in number order: each heap starts sorted
                self.ready[plan.stage_of[number]][plan.kinds[number]].append(number)
        self.orders: list[list[Action]] = [[] for _ in range(plan.stages)]
        self.held = [0] * plan.stages
        self.pending: list[deque[Action]] = [deque() for _ in range(plan.stages)]

    def run(self) -> tuple[int, tuple[tuple[Action, ...], ...]]:
        """The number of unit steps and every stage's order, Ws included."""
        remaining = 3 * sum(len(numbers) for numbers in self.lists) // 2
        step = 0
        while remaining:
            # Every stage chooses before any records: what runs at a step is ready at the next.
            ran = [self._choose(stage) for stage in range(self.stages)]
            if all(chosen is None for chosen in ran):  # all wait on the cap or on each other
                ran = [self._any_ready(stage) for stage in range(self.stages)]
            if all(chosen is None for chosen in ran):
                raise Stalled(step)
            for stage, chosen in enumerate(ran):
                if chosen is not None:
                    self._record(stage, chosen)
                    remaining -= 1
            step += 1
        return step, tuple(tuple(actions) for actions in self.orders)

    def _fits(self, stage: int, kind: int) -> bool:
        return kind == _I or self.held[stage] + self.need[kind] <= self.cap

    def _choose(self, stage: int) -> int | Action | None:
        """The first ready action in the window, else (or when the cap refuses the head) a W."""
        numbers, pending, waiting = self.lists[stage], self.pending[stage], self.waiting
        for index, number in enumerate(numbers[: self.window]):
            if waiting[number]:
                continue
            if self._fits(stage, self.plan.kinds[number]):
                del numbers[index]
                self.taken[number] = 1
                return number
            if index == 0 and pending:
                break  # the head forward waits for memory: free some first
        return pending.popleft() if pending else None

    def _any_ready(self, stage: int) -> int | None:
        """The first ready action of the stage's list that fits: the way out when all would wait.

        With room, the oldest micro-batch in flight always has one: every stage it
        reaches holds nothing of later micro-batches on the way down, and on the way
        back up at most the forwards down, which left a slot free.
        """
        first: list[int] | None = None
        for kind, heap in enumerate(self.ready[stage]):
            while heap and self.taken[heap[0]]:
                heapq.heappop(heap)
            if heap and self._fits(stage, kind) and (first is None or heap[0] < first[0]):
                first = heap
        if first is None:
            return None
        number = heapq.heappop(first)
        numbers = self.lists[stage]
        del numbers[bisect.bisect_left(numbers, number)]
        self.taken[number] = 1
        return number

    def _record(self, stage: int, chosen: int | Action) -> None:
        if isinstance(chosen, int):
            action = self.plan.actions[chosen]
            self._finish(chosen)
        else:
            action = chosen  # a W: nothing in the lists waits for it
        self.orders[stage].append(action)
        op = action.op
        self.held[stage] += _HELD_CHANGE[op]
        if op is OP_I:
            self.pending[stage].append(Action(OP_W, action.microbatch, action.chunk))

    def _finish(self, number: int) -> None:
        """Count ``number``'s waiters down; those it was the last need of are ready next step."""
        plan, waiting = self.plan, self.waiting
        for waiter in plan.waiters[number]:
            waiting[waiter] -= 1
            if not waiting[waiter]:
                heapq.heappush(self.ready[plan.stage_of[waiter]][plan.kinds[waiter]], waiter)


_HELD_CHANGE = {OP_F: 1, OP_I: 0, OP_W: -1}  # activations a stage holds after each op
