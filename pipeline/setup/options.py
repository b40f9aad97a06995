"""A Pipe's arguments checked: the model, counts, the schedule and its chunks, balance, devices."""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from partitioners import uniform
from schedules import (Schedule, ScheduleError, get_schedule, normalize_name, parse_csv,
                       read_schedule, schedule_info, schedule_names, validate)



def check_model(model: Any) -> nn.Module:
    """Return ``model`` if it is an nn.Module (an nn.Sequential: not empty), else raise."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"Pipe needs an nn.Module (an nn.Sequential is cut at its layers, any other module "
            f"is traced and cut into units), got {type(model).__name__}"
        )
    if isinstance(model, (nn.ModuleList, nn.ModuleDict)):
        raise TypeError(
            f"Pipe needs a model it can call, got a {type(model).__name__} (it has no forward): "
            f"wrap its layers in nn.Sequential(...), or pass the module that loops over it"
        )
    if isinstance(model, nn.Sequential) and len(model) == 0:
        raise ValueError("Pipe needs an nn.Sequential with at least one layer, got an empty one")
    return model


def check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


ScheduleArgument = str | os.PathLike[str] | Schedule


def schedule_argument(schedule: ScheduleArgument) -> str | Schedule:
    """A registered name (or ``"auto"``) as it is; a Schedule; else a timetable read from the
    text (``str(schedule)``'s form, or CSV) or from the file it names (CSV by a ``.csv`` suffix).

    Raises:
        TypeError: neither a string, a path nor a Schedule.
        FileNotFoundError: a path (a ``.txt``/``.csv`` name) to no file.
        ScheduleError: text that is not a timetable, naming the line.
        ValueError: a string that is none of these, listing the names.
    """
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, os.PathLike):
        return read_schedule(schedule)
    if not isinstance(schedule, str):
        raise TypeError(
            f"schedule must be a name or a Schedule, got {type(schedule).__name__} (a "
            f"timetable as text, or a path to a file holding one, works too)"
        )
    if "\n" in schedule or schedule.lstrip().startswith("stage"):
        return _timetable(schedule)
    if schedule == "auto" or normalize_name(schedule) in schedule_names():
        return schedule
    if os.path.isfile(schedule):
        return read_schedule(schedule)
    if schedule.lower().endswith((".txt", ".csv")) or os.sep in schedule:
        raise FileNotFoundError(f"schedule={schedule!r} names a timetable file, but there is "
                                f"no such file")
    raise ValueError(
        f"unknown schedule {schedule!r}; expected one of: {', '.join(schedule_names())}; "
        f"or a timetable as text (one line per stage: 'stage 0: F0 F1 B0 B1'), or a path to "
        f"a file holding one"
    )


@lru_cache(maxsize=8)
def _timetable(text: str) -> Schedule:
    # Cached: a Pipe asks for the stage count, the chunks and the schedule in turn.
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if first[:1].isdigit() or first.startswith(","):  # torchtitan's CSV: '0F0,0F1,...'
        return parse_csv(text)
    return Schedule.parse(text)


def build_schedule(
    schedule: ScheduleArgument, stages: int, microbatches: int, options: dict[str, Any]
) -> Schedule:
    """The Schedule to run: built by name, or the given one (or text, or file) checked
    against the counts and validated.

    Raises:
        ValueError: counts that differ from the Pipe's.
        ScheduleError: a timetable that cannot run (missing, misplaced or deadlocked
            actions), or one of forwards alone (a Pipe trains).
    """
    given, schedule = schedule, schedule_argument(schedule)
    if isinstance(schedule, Schedule):
        if schedule.stages != stages or schedule.microbatches != microbatches:
            said, fix = (("the Schedule was built for", "build it with those counts")
                         if isinstance(given, Schedule) else
                         ("the timetable has", f"write one with those counts, or pass "
                                               f"chunks={schedule.microbatches}"))
            raise ValueError(
                f"{said} stages={schedule.stages}, microbatches={schedule.microbatches}, "
                f"but this Pipe has stages={stages}, chunks={microbatches}; {fix}"
            )
        if schedule.forward_only:
            raise ScheduleError(
                f"the {schedule.name} timetable runs forwards only; a Pipe trains with it "
                f"(pipe(x) derives its own forwards): give every forward its backward, B or "
                f"I and W"
            )
        validate(schedule)  # a missing or deadlocked action raises here, not mid-step
        return schedule
    return get_schedule(schedule, stages, microbatches, **options)


def chunks_per_stage(schedule: ScheduleArgument, options: dict[str, Any]) -> int:
    """How many model chunks each stage holds under ``schedule`` (a registry fact)."""
    schedule = schedule_argument(schedule)
    if isinstance(schedule, Schedule):
        return schedule.chunks // schedule.stages
    return schedule_info(schedule).chunks(**options)


def uniform_balance(layers: int, parts: int) -> list[int]:
    """Layers per part, as even as possible (``partitioners.uniform``), with a Pipe's wording."""
    if parts > layers:
        raise ValueError(
            f"cannot cut {layers} layers into {parts} model chunks: expected at most "
            f"{layers} chunks (one layer each at least)"
        )
    return uniform(layers, parts)


def check_balance(balance: Sequence[int], layers: int, parts: int) -> list[int]:
    """Return ``balance`` as a list if it has ``parts`` positive entries summing to ``layers``."""
    balance = list(balance)
    if len(balance) != parts:
        raise ValueError(
            f"balance must have one entry per model chunk: expected {parts}, got "
            f"{len(balance)} ({balance})"
        )
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in balance):
        raise ValueError(f"balance entries must be ints >= 1, got {balance}")
    if sum(balance) != layers:
        raise ValueError(
            f"balance must sum to the model's {layers} layers, got {balance} "
            f"(sum {sum(balance)})"
        )
    return balance


def count_stages(
    schedule: ScheduleArgument,
    devices: Sequence[Any] | None,
    balance: Any,
    stages: int | None,
    per_stage: int,
    implied: dict[str, int],
) -> tuple[int, str]:
    """The stage count every argument that implies one agrees on, and where it came from;
    ``implied``: what the processes say (``Processes.implied_stages``: a group's size).

    Raises:
        ValueError: the arguments disagree, or nothing tells the count (and no GPU does).
    """
    candidates: dict[str, int] = {}
    given, schedule = schedule, schedule_argument(schedule)
    if isinstance(schedule, Schedule):
        key = "schedule.stages" if isinstance(given, Schedule) else "the timetable's stages"
        candidates[key] = schedule.stages
    candidates.update(implied)
    if devices is not None:
        candidates["len(devices)"] = len(devices)
    if stages is not None:
        candidates["stages"] = check_positive("stages", stages)
    if isinstance(balance, (list, tuple)) and not candidates:
        if len(balance) % per_stage:
            raise ValueError(
                f"balance has {len(balance)} entries, not a multiple of the "
                f"{per_stage} chunks per stage this schedule uses"
            )
        candidates["len(balance)"] = len(balance) // per_stage
    if not candidates:
        if torch.cuda.is_available():
            return torch.cuda.device_count(), "one stage per CUDA device"
        raise ValueError(
            "cannot tell how many stages to use: pass balance=[...], devices=[...], "
            "stages=N or a Schedule"
        )
    values = set(candidates.values())
    if len(values) > 1:
        said = ", ".join(f"{k}={v}" for k, v in candidates.items())
        raise ValueError(f"the stage count must agree everywhere, got {said}")
    source, count = next(iter(candidates.items()))
    return count, f"{count} stages from {source} x {per_stage} chunks per stage"
