"""What data-parallel replicas add to a plan: ring collectives, and where they fall on a step.

With data-parallel replicas (``replicas_costs``) every FSDP shard group (a layer holding
parameters) costs ring collectives over the replicas (``ring_seconds``): whole copies
all-reduce each shard group's gradients once per step after the stage's last backward; shards
all-gather each shard group once per step at its first forward and reduce-scatter its gradients
once after the last backward, or, with ``reshard_after_forward``, gather it again for
every forward and backward that finds it freed (``gathers_per_action``). The gathers
once per step lie on micro-batch 0's way through every chunk, and the reductions after
each stage's last action, outside any action: ``with_step_collectives`` puts both on
the simulated timeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from partitioners.cut.memory import DataParallelism, sharded_fixed_bytes
from partitioners.plan.costs import ChunkSums, Hop, tied_copies, stage_params
from schedules import Costs, Event, Link, Op, Schedule, Timeline, memory_traces


def ring_seconds(nbytes: float, replicas: int, link: Link) -> float:
    """Seconds of one ring all-gather or reduce-scatter of ``nbytes`` (the whole tensor).

    ``replicas - 1`` steps, each moving ``nbytes / replicas`` over one hop:
    ``(replicas - 1) x (latency + nbytes / replicas / bandwidth)``, the textbook ring
    (each rank sends and receives ``(replicas - 1) / replicas`` of the bytes, and every
    step waits for a message). An all-reduce is a reduce-scatter then an all-gather,
    twice this. 0 with one replica or no bytes.

    >>> ring_seconds(4e6, 4, Link(latency=1e-5, bandwidth=1e9))
    0.00303
    """
    if replicas < 2 or nbytes <= 0:
        return 0.0
    return (replicas - 1) * (link.latency + nbytes / replicas / link.bandwidth)


def gathers_per_action(schedule: Schedule) -> tuple[dict[Op, float], ...]:
    """Per chunk, the mean all-gathers of its shard groups per ``F``, ``B`` and ``I`` action when
    gathered parameters are freed after every forward (``reshard_after_forward``).

    Walks each stage's order: a forward gathers the chunk unless it is still gathered and
    frees it after; a backward gathers it unless gathered and frees it after too, except
    in a schedule that splits backwards, which keeps it for the W (so a forward right
    after an ``I`` gathers nothing). A recomputed backward's re-run forward costs its
    ``F`` again (``schedules.Costs`` adds it), the gather included.

    >>> from schedules import get_schedule
    >>> gathers_per_action(get_schedule("1f1b", 2, 4))[0] == {Op.F: 1.0, Op.B: 1.0, Op.I: 0.0}
    True
    >>> gathers_per_action(get_schedule("zb-h1", 2, 4))[0][Op.F]  # after an I, still gathered
    0.5
    """
    keeps = bool(schedule.split_backward)
    gathered = [False] * schedule.chunks
    counts = [{op: [0, 0] for op in (Op.F, Op.B, Op.I)} for _ in range(schedule.chunks)]
    for order in schedule.order:
        for action in order:
            if action.op is Op.W:
                continue
            tally = counts[action.chunk][action.op]
            tally[0] += not gathered[action.chunk]
            tally[1] += 1
            gathered[action.chunk] = keeps and action.op is not Op.F
    return tuple({op: done / total if total else 0.0 for op, (done, total) in chunk.items()}
                 for chunk in counts)


@dataclass(frozen=True)
class StepCollectives:
    """What the replicas' collectives add to a step outside its actions (seconds).

    Attributes:
        first: all-gathers once per step, on micro-batch 0's way through the chunks.
        last: per stage, its gradients' reduction after its last action.
    """

    first: float = 0.0
    last: tuple[float, ...] = ()


def replicas_costs(costs: Costs, sums: ChunkSums, schedule: Schedule,
                   data_parallel: DataParallelism, hop: Hop, optimizer_factor: float
                   ) -> tuple[Costs, StepCollectives]:
    """A candidate's ``costs`` (from ``candidate_costs``) with its replicas: the fixed bytes
    of ``sharded_fixed_bytes`` per stage, the gathers of ``reshard_after_forward`` on the
    actions, and the collectives outside the actions (see the module docstring).

    Each chunk's FSDP shard groups are its layers holding parameters (a tied copy its stage holds
    is one more); whole copies all-reduce per shard group. The ring's hop is
    ``data_parallel.link``, else ``hop`` (a number: a latency per step, bytes free).
    """
    if not data_parallel.active:
        return costs, StepCollectives()
    link = data_parallel.link or (hop if isinstance(hop, Link) else Link(latency=float(hop)))
    shard_groups = [list(chunk) for chunk in sums.shard_groups] or [[p] for p in sums.params]
    for chunk, nbytes in tied_copies(sums, schedule.placement):
        shard_groups[chunk].append(nbytes)
    replicas, sharded = data_parallel.replicas, data_parallel.sharded
    gather = [sum(ring_seconds(u, replicas, link) for u in chunk) for chunk in shard_groups]
    reduce = [g if sharded else 2 * g for g in gather]
    last = tuple(sum(reduce[c] for c in owned) for owned in schedule.chunks_of_stage)
    if not sharded:
        return costs, StepCollectives(0.0, last)
    params = stage_params(sums, schedule.placement)
    fixed = [0.0] * schedule.chunks
    for owned in schedule.chunks_of_stage:
        fixed[owned[0]] = sharded_fixed_bytes(
            sum(params[c] for c in owned), optimizer_factor,
            [u for c in owned for u in shard_groups[c]], data_parallel,
            bool(schedule.split_backward))
    costs = replace(costs, fixed_bytes=tuple(fixed))
    if not data_parallel.reshard_after_forward:
        return costs, StepCollectives(sum(gather), last)
    return with_gathers(costs, gather, gathers_per_action(schedule)), StepCollectives(0.0, last)


def with_gathers(costs: Costs, gather: Sequence[float],
                 per_action: Sequence[dict[Op, float]]) -> Costs:
    """``costs`` (per chunk, backward given) with ``gather[c] x per_action[c][op]`` seconds
    added to each chunk's F, B and I."""
    def added(values: object, op: Op) -> tuple[float, ...]:
        assert isinstance(values, tuple), "expected per-chunk times"
        return tuple(v + g * share[op] for v, g, share in zip(values, gather, per_action))

    return replace(costs, forward=added(costs.forward, Op.F),
                   backward=added(costs.backward, Op.B),
                   input_grad=added(costs.input_grad, Op.I))


def with_step_collectives(timeline: Timeline, costs: Costs, schedule: Schedule,
                          collectives: StepCollectives) -> Timeline:
    """``timeline`` with the collectives outside the actions.

    The gathers once per step (``first``) delay micro-batch 0's forward on every chunk,
    and every action follows that forward: every event starts ``first`` later except the
    step's first forward, which starts where it did and lasts ``first`` longer (an upper
    bound: a stage off the critical path may have hidden its gather). Each stage's last
    action lasts ``last[stage]`` longer: the gradients' reduction after it. Memory is
    traced again (``schedules.memory_traces``). Without either, ``timeline`` itself.
    """
    first, last = collectives.first, collectives.last or (0.0,) * timeline.stages
    if first == 0 and not any(last):
        return timeline
    origin = timeline.start
    events = []
    for stage in range(timeline.stages):
        mine = timeline.stage_events(stage)
        for index, event in enumerate(mine):
            tail = last[stage] if index == len(mine) - 1 else 0.0
            start = event.start if event.start == origin else event.start + first
            events.append(Event(stage, event.action, start, event.end + first + tail))
    bound = timeline.makespan_bound
    shifted = Timeline(timeline.stages, tuple(events), timeline.chunks_per_stage, timeline.name,
                       None if bound is None else bound + first)
    if not timeline.memory:
        return shifted
    return replace(shifted, memory=memory_traces(shifted, costs.resolve(schedule)))
