"""The plan a Pipe's ranks agree on for ``chunks="auto"`` / ``schedule="auto"``: profiled and
searched on rank 0 (``Ranks.decide``), the same on every rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from schedules.recompute import CHECKPOINT_MODES, check_mode
from split_backward import SplitMode
from units import Cut

from pipeline.group.distributed import Distributed
from pipeline.group.ranks import Ranks
from pipeline.setup.options import check_positive

if TYPE_CHECKING:
    from schedules import Link


def choose_plan(cut: Cut, chunks: Any, schedule: Any, checkpoint: Any, stages: int,
                samples: tuple[Any, Any, Any], devices: Sequence[torch.device],
                memory_limit: float | None, ranks: Ranks,
                deciders: Ranks | None = None, data_parallel: Any = None,
                split_backward: SplitMode = "auto", tensor_parallel: Any = None,
                expert_parallel: Any = None) -> Any:
    """The ``partitioners.Plan`` for ``chunks="auto"`` / ``schedule="auto"``, the same on every
    rank: what is fixed (a count, a schedule name, a checkpoint mode) is kept. ``samples``
    is (a batch, its target or None, the loss function or None): with both of the last
    two, the loss is profiled too. ``ranks`` (the pipeline) calibrate the hop between
    stages; ``deciders`` (default ``ranks``; in a mesh every rank of it, so that replicas
    and tensor-parallel ranks run one plan) take their first rank's plan;
    ``data_parallel`` (a ``partitioners.DataParallelism``) prices the replicas,
    ``tensor_parallel`` (``partitioners.plan.tensor_parallel.TensorParallelism``) the tp
    ranks' shares and all-reduces, ``expert_parallel``
    (``partitioners.plan.expert_parallel.ExpertParallelism``) the ep ranks' shares of the
    experts and their all-to-alls; ``split_backward`` is the Pipe's, so that the I and W
    priced are those it runs."""
    sample, target, loss_fn = samples
    from partitioners import plan_for_model

    if not isinstance(schedule, str):
        raise ValueError(
            f"schedule='auto' or a name with chunks='auto', got a {type(schedule).__name__}"
        )

    hop = _calibrated_hop(stages, devices, ranks)  # every rank takes part

    def make() -> Any:
        from pipeline.predict.overheads import action_overhead

        if sample is None:
            raise ValueError(
                "chunks='auto' or schedule='auto' needs a batch to profile: pass sample=x "
                "(with a group: on rank 0, which plans for every rank)"
            )
        first = sample[0] if isinstance(sample, list) else sample
        with_loss = target is not None and loss_fn is not None
        return plan_for_model(
            cut, first, target if with_loss else None, loss_fn if with_loss else None,
            stages=stages, memory_limit=memory_limit, devices=list(devices)[:1],
            hop=hop, action_overhead=action_overhead(devices[0]),
            microbatch_counts=None if chunks == "auto" else [check_positive("chunks", chunks)],
            schedules=None if schedule == "auto" else [schedule],
            checkpoints=CHECKPOINT_MODES if checkpoint in (None, "auto")
            else (check_mode(checkpoint),),
            data_parallel=data_parallel, split_backward=split_backward,
            tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
        )

    return (deciders or ranks).decide(make, "planning")


def _calibrated_hop(stages: int, devices: Sequence[torch.device], ranks: Ranks) -> Link | None:
    """The hop between the first two stages, calibrated as ``Pipe.predict``'s is (a ping-pong
    across ranks, or between two stage threads), taken for every pair: a ``schedules.Link``,
    or None with one stage."""
    from schedules import get_schedule

    if stages < 2:
        return None
    return ranks.hops(devices, get_schedule("1f1b", stages=stages, microbatches=stages)).link(0, 1)


def replicas_of(settings: Distributed | None, device: torch.device, timeout: float) -> Any:
    """A ``partitioners.DataParallelism`` for the plan: the data group's size, FSDP or not,
    and the slowest hop between replicas (every replica calibrates it); None without. With
    expert parallelism the ranks sharing the batch are ``dp`` x ``ep`` (``batch_group``):
    what they reduce is priced as if every parameter were (the experts' over ``dp`` only)."""
    group = settings.batch_group or settings.data_group if settings is not None else None
    if settings is None or group is None:
        return None
    import torch.distributed as dist

    from partitioners.cut.memory import DataParallelism
    from pipeline.group.links import slowest_link

    return DataParallelism(dist.get_world_size(group),
                           settings.data_parallel == "fsdp", settings.reshard_after_forward,
                           slowest_link(group, device, timeout))


def tensor_parallelism_of(settings: Distributed | None, cut: Cut, device: torch.device,
                          timeout: float) -> Any:
    """A ``TensorParallelism`` for the plan where a plan by names splits ``cut`` over a
    ``tp`` dimension: per unit, the share of its parameter bytes in split modules and its
    row-split products, and the slowest hop between tp ranks (every tp rank calibrates
    it). None without, or for ``fn(layer, tp_mesh)`` (what it splits is not known here)."""
    tp_mesh = settings.tp_mesh if settings is not None else None
    plan = settings.tensor_parallel if settings is not None else None
    if tp_mesh is None or plan is None or callable(plan):
        return None
    from partitioners.plan.tensor_parallel import TensorParallelism
    from pipeline.group.links import slowest_link
    from units.tp_plan import SPLITTING, resolve_plan

    styles = resolve_plan(cut.model, plan)
    split: list[float] = []
    reductions: list[int] = []
    for info, unit in zip(cut.infos, cut.units):
        mine = {name: style for name, style in styles.items()
                if any(name == held or name.startswith(f"{held}.") for held in info.modules)}
        whole = sum(p.numel() for p in unit.parameters())
        parts = sum(p.numel() for name, style in mine.items() if style.name in SPLITTING
                    for p in cut.model.get_submodule(name).parameters())
        split.append(min(1.0, parts / whole) if whole else 0.0)
        reductions.append(sum(style.name == "rowwise" for style in mine.values()))
    return TensorParallelism(tp_mesh.size(), tuple(split), tuple(reductions),
                             slowest_link(tp_mesh.get_group(), device, timeout))


def expert_parallelism_of(settings: Distributed | None, cut: Cut, device: torch.device,
                          timeout: float) -> Any:
    """An ``ExpertParallelism`` for the plan where experts are spread over an ``ep``
    dimension: per unit, the share of its parameter bytes in experts modules, its experts
    modules, the experts a token picks (the config's ``num_experts_per_tok``, the holding
    module's ``top_k``, else 2), and the slowest hop between ep ranks (every ep rank
    calibrates it). None without."""
    ep_mesh = settings.ep_mesh if settings is not None else None
    if settings is None or ep_mesh is None or settings.expert_parallel is None:
        return None
    from partitioners.plan.expert_parallel import ExpertParallelism
    from pipeline.group.links import slowest_link
    from units.ep_plan import resolve_expert_plan

    names = resolve_expert_plan(cut.model, settings.expert_parallel)
    experts: list[float] = []
    exchanges: list[int] = []
    picks: list[int] = []
    for info, unit in zip(cut.infos, cut.units):
        mine = [name for name in names
                if any(key.startswith(f"{name}.") for key in info.parameters)]
        whole = sum(p.numel() for p in unit.parameters())
        held = sum(p.numel() for name in mine for p in cut.model.get_submodule(name).parameters())
        experts.append(min(1.0, held / whole) if whole else 0.0)
        exchanges.append(len(mine))
        picks.append(max((_picks(cut.model, name) for name in mine), default=0))
    return ExpertParallelism(ep_mesh.size(), tuple(experts), tuple(exchanges), tuple(picks),
                             slowest_link(ep_mesh.get_group(), device, timeout))


def _picks(model: Any, name: str) -> int:
    """The experts each token picks for experts module ``name``."""
    config = getattr(model, "config", None)
    for value in (getattr(config, "num_experts_per_tok", None),
                  getattr(model.get_submodule(name.rpartition(".")[0]), "top_k", None)):
        if isinstance(value, int) and value > 0:
            return value
    return 2
