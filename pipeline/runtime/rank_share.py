"""What one rank keeps of a schedule: its own stage's steps, derived and proven once at build.

Every rank builds the whole comm plans (training and forward-only) because the plan is one
global derivation (``schedules.comm_plan``: a rendezvous simulation over every stage), and
``validate_comm`` proves them under NCCL's rules once, here, at build. Then the rank keeps
only its stage's part (``StageSteps``, arrays) and the channels every rank opens; the whole
plans go when ``rank_share`` returns. At 64 stages a whole plan is 10^5 to 10^6 steps: kept
alive on every rank, it cost each full garbage collection a scan of all of them and each
rank P times the memory of what it runs. ``benchmarks/bench_rank_share.py`` measures both.
"""

from __future__ import annotations

from dataclasses import dataclass

from schedules import Schedule, comm_plan, forward_only, validate_comm
from schedules.comm import Strategy

from pipeline.runtime.stage_steps import StageSteps


@dataclass(frozen=True, eq=False)
class RankShare:
    """What the rank running ``stage`` keeps of a schedule.

    Attributes:
        stage: the stage.
        training: its steps of a training step (``Pipe.step``).
        forward: its steps of a forward-only call (``pipe(x)``).
        channels: the channels of both whole plans, sorted: every rank opens a communicator
            for each (a collective), so they are the same on every rank.
    """

    stage: int
    training: StageSteps
    forward: StageSteps
    channels: tuple[int, ...]

    def steps(self, infer: bool) -> StageSteps:
        """The forward-only steps with ``infer``, else the training ones."""
        return self.forward if infer else self.training


def rank_share(schedule: Schedule, stage: int, strategy: Strategy = "overlap",
               prove: bool = True) -> RankShare:
    """Stage ``stage``'s share of ``schedule``: what ``DistRunner`` keeps on its rank.

    Args:
        schedule: the training timetable (validated by ``comm_plan``).
        stage: the rank's stage, ``0 <= stage < schedule.stages``.
        strategy: the comm plan's strategy (``schedules.comm_plan``).
        prove: run ``validate_comm`` on both whole plans before keeping a part of them.

    Returns:
        The RankShare; nothing of the other stages' steps stays reachable from it.

    Raises:
        ValueError: ``stage`` out of range.
        ScheduleError: the schedule is invalid, or a plan fails the proof.
    """
    if isinstance(stage, bool) or not isinstance(stage, int) \
            or not 0 <= stage < schedule.stages:
        raise ValueError(f"stage: expected an int in 0..{schedule.stages - 1}, got {stage!r}")
    training = comm_plan(schedule, strategy)
    forward = comm_plan(forward_only(schedule))
    if prove:
        validate_comm(training)
        validate_comm(forward)
    channels = tuple(sorted(set(training.channels) | set(forward.channels)))
    return RankShare(stage, StageSteps.of(training, stage), StageSteps.of(forward, stage),
                     channels)
