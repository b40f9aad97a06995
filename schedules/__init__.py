"""Pipeline schedules as data: generate, validate, simulate and draw timetables (no torch)."""

from schedules.action import Action, Op, Schedule, ScheduleError
from schedules.dependencies import Transfer, dependencies, replay, stage_of, transfers
from schedules.gpipe import gpipe
from schedules.interleaved import interleaved_1f1b
from schedules.onefoneb import one_f_one_b
from schedules.plot import plot_timeline
from schedules.registry import get_schedule, schedule_names
from schedules.registry import ScheduleInfo, normalize_name, schedule_info
from schedules.dualpipe import dualpipe_v
from schedules.v_shape import v_half, v_min
from schedules.zb import zero_bubble_capped
from schedules.simulate import simulate, simulate_measured
from schedules.costs import Costs, Link, ResolvedCosts
from schedules.simulate import memory_traces
from schedules.timeline import Event, Timeline
from schedules.timeline import MemoryTrace
from schedules.validate import validate
from schedules.comm_validate import validate_comm
from schedules.comm import CommPlan, comm_plan
from schedules.comm_ops import CommOp, Group
from schedules.forward import forward_only
from schedules.text import parse_csv, read_schedule, to_csv
from schedules.zero_bubble import zero_bubble_h1, zero_bubble_h2
from schedules.zero_bubble_v import zero_bubble_v

__all__ = [
    "Action",
    "Event",
    "Op",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "Transfer",
    "dependencies",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "plot_timeline",
    "replay",
    "schedule_names",
    "simulate",
    "simulate_measured",
    "stage_of",
    "transfers",
    "validate",
    "zero_bubble_h1",
    "zero_bubble_h2",
    "zero_bubble_v",
    "ScheduleInfo",
    "normalize_name",
    "schedule_info",
    "dualpipe_v",
    "v_half",
    "v_min",
    "zero_bubble_capped",
    "CommOp",
    "CommPlan",
    "Group",
    "comm_plan",
    "forward_only",
    "validate_comm",
    "Costs",
    "Link",
    "MemoryTrace",
    "ResolvedCosts",
    "memory_traces",
    "parse_csv",
    "read_schedule",
    "to_csv",
]
