"""Schedules by name, and what each one is: chunks per stage, placement, split backward, memory."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from schedules.action import Schedule
from schedules.dualpipe import dualpipe_v
from schedules.gpipe import gpipe
from schedules.interleaved import interleaved_1f1b
from schedules.onefoneb import one_f_one_b
from schedules.v_shape import v_half, v_min
from schedules.zb import zero_bubble_capped
from schedules.zero_bubble import zero_bubble_h1, zero_bubble_h2
from schedules.zero_bubble_v import zero_bubble_v

Placement = Literal["loop", "v"]
MemoryFormula = Callable[..., tuple[float, ...]]


@dataclass(frozen=True)
class ScheduleInfo:
    """A registered schedule and the facts a runtime or planner needs without building it.

    Attributes:
        name: the registered name (``"zb-v"``).
        generator: ``generator(stages, microbatches, **options) -> Schedule``.
        chunks_per_stage: model chunks per stage with the default options; see
            :meth:`chunks` when an option changes it.
        placement: ``"loop"`` (chunk c on stage c mod P) or ``"v"`` (chunk c on stage
            ``min(c, 2P-1-c)``).
        split_backward: whether backwards are split into I and W (any of them).
        options: the generator's keyword options and their defaults.
        memory: ``memory(stages, microbatches, **options)`` -> per stage, the most
            full-stage micro-batches whose activations it holds at once; exactly
            ``Timeline.peak_activations`` of the generated schedule (which does not
            depend on costs).
        min_microbatches: ``min_microbatches(stages)`` -> the fewest micro-batches
            the generator accepts, or None when any M >= 1 works.
    """

    name: str
    generator: Callable[..., Schedule]
    chunks_per_stage: int
    placement: Placement
    split_backward: bool
    memory: MemoryFormula
    options: Mapping[str, Any] = field(default_factory=dict)
    min_microbatches: Callable[[int], int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    def chunks(self, **options: Any) -> int:
        """Chunks per stage under ``options`` (only ``chunks_per_stage`` can change it)."""
        if "chunks_per_stage" in self.options:
            return int(options.get("chunks_per_stage", self.options["chunks_per_stage"]))
        return self.chunks_per_stage

    def build(self, stages: int, microbatches: int, **options: Any) -> Schedule:
        """The schedule, after checking that every option is one this generator takes."""
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            known = ", ".join(self.options) or "none"
            raise ValueError(
                f"schedule {self.name!r} takes options: {known}; got {', '.join(unknown)}"
            )
        return self.generator(stages, microbatches, **options)


def _uniform(value: Callable[[int, int], float]) -> MemoryFormula:
    def memory(stages: int, microbatches: int, **options: Any) -> tuple[float, ...]:
        return (float(value(stages, microbatches)),) * stages

    return memory


def _one_f_one_b_memory(stages: int, microbatches: int) -> tuple[float, ...]:
    return tuple(float(min(stages - stage, microbatches)) for stage in range(stages))


def _zb_memory(stages: int, microbatches: int, max_inflight: int | None = None) -> tuple[float, ...]:
    cap = stages if max_inflight is None else max_inflight
    extra = max(0, min(cap - stages, stages - 1, microbatches - stages))
    return (float(min(stages + extra, microbatches)),) * stages


def _counted(name: str) -> MemoryFormula:
    """Memory read off the generated order, for schedules without a closed form."""

    def memory(stages: int, microbatches: int, **options: Any) -> tuple[float, ...]:
        from schedules.simulate import simulate  # peak activations do not depend on costs

        schedule = REGISTRY[name].build(stages, microbatches, **options)
        return simulate(schedule).peak_activations

    return memory


REGISTRY: Mapping[str, ScheduleInfo] = MappingProxyType({
    info.name: info
    for info in (
        ScheduleInfo("gpipe", gpipe, 1, "loop", False, _uniform(lambda p, m: m)),
        ScheduleInfo("1f1b", one_f_one_b, 1, "loop", False, _one_f_one_b_memory),
        ScheduleInfo("interleaved-1f1b", interleaved_1f1b, 2, "loop", False,
                     _counted("interleaved-1f1b"), {"chunks_per_stage": 2}),
        ScheduleInfo("zb-h1", zero_bubble_h1, 1, "loop", True, _uniform(min)),
        ScheduleInfo("zb-h2", zero_bubble_h2, 1, "loop", True,
                     lambda p, m: _zb_memory(p, m, 2 * p - 1)),
        ScheduleInfo("zb-v", zero_bubble_v, 2, "v", True, _counted("zb-v")),
        ScheduleInfo("zb", zero_bubble_capped, 1, "loop", True, _zb_memory,
                     {"max_inflight": None}),
        ScheduleInfo("v-half", v_half, 2, "v", True, _counted("v-half")),
        ScheduleInfo("v-min", v_min, 2, "v", True, _counted("v-min")),
        ScheduleInfo("dualpipe-v", dualpipe_v, 2, "v", True,
                     _uniform(lambda p, m: p + 0.5), {"overlap": False},
                     min_microbatches=lambda p: 2 * p),
    )
})
GENERATORS: Mapping[str, Callable[..., Schedule]] = MappingProxyType(
    {name: info.generator for name, info in REGISTRY.items()}
)


def normalize_name(name: str) -> str:
    """The registry key for ``name``: case, spaces around and ``_`` for ``-`` do not count."""
    return str(name).strip().lower().replace("_", "-")


def schedule_names() -> tuple[str, ...]:
    """The names ``get_schedule`` knows."""
    return tuple(REGISTRY)


def schedule_info(name: str) -> ScheduleInfo:
    """The registry entry for ``name`` (normalised by ``normalize_name``).

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    key = normalize_name(name)
    if key not in REGISTRY:
        known = ", ".join(REGISTRY)
        raise ValueError(f"unknown schedule {name!r}; expected one of: {known}")
    return REGISTRY[key]


def get_schedule(name: str, stages: int, microbatches: int, **options: Any) -> Schedule:
    """Build the schedule called ``name`` (see ``schedule_names()``).

    Args:
        name: e.g. ``"gpipe"`` or ``"1f1b"``; case and ``_``/``-`` are not significant.
        stages: number of pipeline stages.
        microbatches: number of micro-batches per step.
        **options: passed to the generator (e.g. ``chunks_per_stage``).

    Raises:
        ValueError: an unknown name (the message lists the known ones), an option the
            generator does not take, or bad counts.
    """
    return schedule_info(name).build(stages, microbatches, **options)
