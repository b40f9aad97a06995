"""validate_comm: a CommPlan checked complete and replayed under NCCL's rules (worst case)."""

from __future__ import annotations

from collections import defaultdict, deque
from typing import TYPE_CHECKING

from schedules._speed import gc_paused
from schedules.action import Action, ScheduleError
from schedules.comm import CommPlan, format_plan
from schedules.comm_ops import MAX_CHANNELS
from schedules.comm_proof import plan_is_sound
from schedules.dependencies import ActionKey, dependency_keys
from schedules.plan_steps import PlanSteps
from schedules.validate import validate

if TYPE_CHECKING:
    from schedules.comm import Step
    from schedules.comm_ops import CommOp


_KINDS = ("send", "recv")
_Message = tuple[ActionKey, int, int]  # (producer, source stage, destination stage)


def validate_comm(plan: CommPlan) -> None:
    """Raise ``ScheduleError`` unless ``plan`` runs to completion under NCCL's rules.

    The rules, at their worst: tags are ignored; per channel and ordered pair of
    stages, the n-th send matches the n-th receive; a send completes only once its
    receive is posted (no buffering); a group's ops are posted together and its
    stage moves on when all have completed. Checks, in order: the schedule is
    valid and the plan keeps its compute order; every cross-stage transfer is sent
    once after its producer and received once before its consumer, on channels
    0..3; matched sends and receives carry the same producer; and the replay ends.
    Linear in the number of steps.

    Raises:
        ScheduleError: naming the stage, step and message at fault and showing the
            plan around it; for a stall, the cycle of stages and the messages each
            one waits on.
    """
    validate(plan.schedule)
    with gc_paused():
        arrays = all(isinstance(steps, PlanSteps) for steps in plan.stages)
        if arrays and plan_is_sound(plan):
            return  # proven on the arrays; what follows names the fault of a plan that is not
        positions, queues = _check_steps(plan)
        _check_messages(plan, positions, queues)
        _check_matching(plan, queues)
        stuck = _replay_comm(plan)
    if stuck:
        _raise_stall(plan, stuck)
    if arrays:  # pragma: no cover - the two agree, the reference table checks it
        raise RuntimeError(f"validate_comm: the proof on arrays refused the {plan.strategy} plan "
                           f"of {plan.schedule.name}, but its replay on objects found no fault")


# (kind, channel, source, destination) -> [(producer key, stage, step)], in posting order
_Queues = dict[tuple[str, int, int, int], list[tuple[ActionKey, int, int]]]


def _plan_fail(plan: CommPlan, message: str, around: dict[int, int]) -> ScheduleError:
    window = format_plan(plan, around=around)
    return ScheduleError(f"{plan.schedule.name} comm plan ({plan.strategy}): {message}\n{window}")


def _check_steps(plan: CommPlan) -> tuple[dict[ActionKey, int], _Queues]:
    """Compute order as the schedule's and well-formed ops; return where each action
    sits (its step on its stage) and every op, queued by channel and pair."""
    schedule = plan.schedule
    stages = schedule.stages
    positions: dict[ActionKey, int] = {}
    queues: _Queues = defaultdict(list)
    for stage, steps in enumerate(plan.stages):
        expected = schedule.order[stage]
        count = 0
        for index, step in enumerate(steps):
            if isinstance(step, Action):
                if count >= len(expected) or not (step is expected[count] or step == expected[count]):
                    want = expected[count] if count < len(expected) else "nothing more"
                    raise _plan_fail(
                        plan, f"stage {stage} computes {step} at step {index}, but the "
                        f"schedule's order has {want} there", {stage: index})
                positions[(step.op, step.microbatch, step.chunk)] = index
                count += 1
            elif hasattr(step, "ops"):
                for op in step.ops:
                    peer, channel = op.peer, op.channel
                    if not (op.kind in _KINDS and peer.__class__ is int and 0 <= peer < stages
                            and peer != stage and channel.__class__ is int
                            and 0 <= channel < MAX_CHANNELS
                            and op.producer.__class__ is Action):
                        _check_op(plan, stage, index, op)  # raises, saying what is wrong
                    pair = (stage, op.peer) if op.kind == "send" else (op.peer, stage)
                    producer = op.producer
                    queues[(op.kind, op.channel, *pair)].append(
                        ((producer.op, producer.microbatch, producer.chunk), stage, index))
            else:
                raise _plan_fail(
                    plan, f"stage {stage} step {index} must be an Action or a Group, got "
                    f"{step!r} ({type(step).__name__})", {stage: index})
        if count != len(expected):
            raise _plan_fail(
                plan, f"stage {stage} never computes {expected[count]}", {stage: len(steps)})
    return positions, queues


def _check_op(plan: CommPlan, stage: int, index: int, op: CommOp) -> None:
    """Raise the error for an op that failed the fast check in ``_check_steps``."""
    if op.kind not in ("send", "recv"):
        problem = f"kind must be 'send' or 'recv', got {op.kind!r}"
    elif not (type(op.peer) is int and 0 <= op.peer < plan.schedule.stages):
        problem = f"peer must be a stage 0..{plan.schedule.stages - 1}, got {op.peer!r}"
    elif op.peer == stage:
        problem = f"peer is the stage itself ({stage}); a result stays local"
    elif not (type(op.channel) is int and 0 <= op.channel < MAX_CHANNELS):
        problem = (f"channel must be 0..{MAX_CHANNELS - 1} (one communicator each, at "
                   f"most {MAX_CHANNELS}), got {op.channel!r}")
    else:
        problem = f"producer must be an Action, got {op.producer!r}"
    raise _plan_fail(plan, f"stage {stage} step {index}: {op}: {problem}", {stage: index})


def _first_uses(plan: CommPlan, positions: dict[ActionKey, int]) -> dict[_Message, int]:
    """``(producer, source, destination)`` -> the step at which the destination first needs it,
    for every cross-stage dependency (the rule of ``dependency_keys``)."""
    schedule = plan.schedule
    placement = schedule.placement
    first: dict[_Message, int] = {}
    for stage, actions in enumerate(schedule.order):
        for action in actions:
            for key in dependency_keys(schedule, action.op, action.microbatch, action.chunk):
                source = placement[key[2]]
                if source != stage and (key, source, stage) not in first:
                    first[(key, source, stage)] = positions[
                        (action.op, action.microbatch, action.chunk)]
    return first


def _check_messages(plan: CommPlan, positions: dict[ActionKey, int], queues: _Queues) -> None:
    """Every transfer sent once after its producer, received once before its consumer."""
    first_use = _first_uses(plan, positions)
    posted: dict[str, dict[_Message, int]] = {"send": {}, "recv": {}}
    for (kind, _, source, destination), ops in queues.items():
        seen = posted[kind]
        arrow = f"-> {destination}" if kind == "send" else f"<- {source}"
        for producer, stage, index in ops:
            key = (producer, source, destination)
            if key in first_use and key not in seen and (
                index > positions[producer] if kind == "send" else index < first_use[key]
            ):
                seen[key] = index
                continue
            what = f"{kind} {_text(producer)} {arrow}"
            if key not in first_use:
                raise _plan_fail(
                    plan, f"stage {stage} step {index}: {what}, but no action on stage "
                    f"{destination} needs {_text(producer)} from stage {source}", {stage: index})
            if key in seen:
                raise _plan_fail(plan, f"stage {stage} posts {what} twice: steps {seen[key]} "
                                 f"and {index}", {stage: index})
            seen[key] = index
            if kind == "send" and index < positions[producer]:
                raise _plan_fail(
                    plan, f"stage {stage} sends {_text(producer)} at step {index}, before "
                    f"producing it at step {positions[producer]}", {stage: index})
            if kind == "recv" and index > first_use[key]:
                consumer = plan.stages[stage][first_use[key]]
                raise _plan_fail(
                    plan, f"stage {stage} receives {_text(producer)} at step {index}, after "
                    f"{consumer} needs it at step {first_use[key]}", {stage: index})
    if len(posted["send"]) == len(posted["recv"]) == len(first_use):
        return
    for (producer, source, destination), at in first_use.items():
        if (producer, source, destination) not in posted["send"]:
            raise _plan_fail(plan, f"stage {source} never sends {_text(producer)} to stage "
                             f"{destination}", {source: positions[producer]})
        if (producer, source, destination) not in posted["recv"]:
            raise _plan_fail(plan, f"stage {destination} never receives {_text(producer)} from "
                             f"stage {source}, needed at step {at}", {destination: at})


def _check_matching(plan: CommPlan, queues: _Queues) -> None:
    """Per channel and ordered pair, the n-th send and the n-th receive carry one producer."""
    for (kind, channel, source, destination), sends in queues.items():
        if kind != "send":
            continue
        receives = queues.get(("recv", channel, source, destination), [])
        if [op[0] for op in sends] == [op[0] for op in receives]:
            continue
        for number, sent in enumerate(sends):
            got = receives[number] if number < len(receives) else None
            if got is None or got[0] != sent[0]:
                expects = (f"stage {destination}'s receive number {number} there expects "
                           f"{_text(got[0])}" if got else
                           f"stage {destination} posts only {len(receives)} receives there")
                around = {source: sent[2]} | ({destination: got[2]} if got else {})
                raise _plan_fail(
                    plan, f"mismatch on channel {channel} from stage {source} to stage "
                    f"{destination}: send number {number} carries {_text(sent[0])}, but "
                    f"{expects}; NCCL ignores tags and would deliver the wrong tensor", around)
    # Every message is sent and received once, so equal send lists leave no receive over.


def _text(key: ActionKey) -> str:
    return str(Action(*key))
def _replay_comm(plan: CommPlan) -> dict[int, int]:
    """Run the plan under the rules; return ``{stage: step}`` of the groups left waiting."""
    stages = plan.stages
    index = [0] * len(stages)
    waiting = [0] * len(stages)  # unmatched ops of the group a stage is in
    posted: dict[tuple[str, int, int, int], int] = defaultdict(int)
    ready = deque(range(len(stages)))
    while ready:
        stage = ready.popleft()
        steps, at = stages[stage], index[stage]
        while at < len(steps):
            step = steps[at]
            at += 1
            if isinstance(step, Action):
                continue
            for op in step.ops:
                if op.kind == "send":
                    mine, theirs = ("send", op.channel, stage, op.peer), ("recv", op.channel,
                                                                          stage, op.peer)
                else:
                    mine, theirs = ("recv", op.channel, op.peer, stage), ("send", op.channel,
                                                                          op.peer, stage)
                number = posted[mine]
                posted[mine] = number + 1
                if number < posted[theirs]:
                    # Its partner was posted first, so the peer is blocked in that group.
                    waiting[op.peer] -= 1
                    if waiting[op.peer] == 0:
                        ready.append(op.peer)
                else:
                    waiting[stage] += 1
            if waiting[stage]:
                break
        index[stage] = at
    return {stage: index[stage] - 1 for stage in range(len(stages)) if waiting[stage]}


def _raise_stall(plan: CommPlan, stuck: dict[int, int]) -> None:
    """Name the cycle of stages waiting on one another's groups, with the plan around them."""
    posted = {stage: _posted(plan.stages[stage], stuck.get(stage)) for stage in stuck}
    waits_on: dict[int, tuple[int, CommOp]] = {}
    for stage, at in stuck.items():
        before = _posted(plan.stages[stage], at - 1)
        group = plan.stages[stage][at]
        assert not isinstance(group, Action)  # a stage is only ever stuck in a group
        for op in group.ops:
            mine = (op.kind, op.channel, op.peer)
            number = before[mine]
            before[mine] += 1
            partner = ("recv" if op.kind == "send" else "send", op.channel, stage)
            if posted[op.peer][partner] <= number:  # a stage it waits on is stuck too
                waits_on[stage] = (op.peer, op)
                break
    cycle = _cycle(waits_on, min(stuck))
    parts = []
    for stage in cycle:
        peer, op = waits_on[stage]
        wanted = "receive" if op.kind == "send" else "send"
        parts.append(f"stage {stage} waits in group {plan.stages[stage][stuck[stage]]} for "
                     f"stage {peer} to post its {wanted} of {op.producer}, which comes later "
                     f"in its plan")
    loop = " -> ".join(str(stage) for stage in cycle + cycle[:1])
    raise _plan_fail(
        plan, "deadlock under NCCL's rules (no tags, in-order matching, a send completes only "
        "when its receive is posted): " + "; ".join(parts) + f"; the cycle {loop} never moves",
        {stage: stuck[stage] for stage in cycle})


def _posted(steps: tuple[Step, ...], last: int | None) -> dict[tuple[str, int, int], int]:
    """Ops posted by (kind, channel, peer) in ``steps[:last + 1]`` (all steps if None)."""
    tally: dict[tuple[str, int, int], int] = defaultdict(int)
    for step in steps if last is None else steps[: last + 1]:
        if not isinstance(step, Action):
            for op in step.ops:
                tally[(op.kind, op.channel, op.peer)] += 1
    return tally


def _cycle(waits_on: dict[int, tuple[int, CommOp]], start: int) -> list[int]:
    """Follow "waits for" from ``start`` until a stage repeats; return the loop."""
    path: list[int] = []
    stage = start
    while stage not in path:
        path.append(stage)
        stage = waits_on[stage][0]
    return path[path.index(stage):]
