"""Pipeline schedules as data: generate, validate, simulate and draw timetables (no torch)."""

from schedules.action import Action, Op, Schedule, ScheduleError
from schedules.dependencies import Transfer, dependencies, replay, stage_of, transfers
from schedules.gpipe import gpipe
from schedules.onefoneb import one_f_one_b
from schedules.plot import plot_timeline
from schedules.registry import get_schedule, schedule_names
from schedules.simulate import simulate
from schedules.timeline import Event, Timeline
from schedules.validate import validate

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
    "one_f_one_b",
    "plot_timeline",
    "replay",
    "schedule_names",
    "simulate",
    "stage_of",
    "transfers",
    "validate",
]
