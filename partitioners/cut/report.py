"""What a cut means: per-stage costs and memory, imbalance, and its predicted step."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from partitioners.measure.cost import LayerCost, LossCost, Profile, saved_bytes_of
from partitioners.measure.sizes import format_bytes
from schedules import Link, Schedule, Timeline, get_schedule, simulate


@dataclass(frozen=True)
class StageReport:
    """One stage of a cut.

    Attributes:
        first, last: the stage's first and last layer indices (inclusive).
        types: its layers' names, in order: type names (``"Linear"``), or a traced
            model's unit names (``"model.layers.3"``).
        forward, backward: summed seconds per micro-batch.
        share: the stage's fraction of the model's forward+backward time.
        param_bytes: its parameters' bytes.
        saved_bytes: what autograd saves per micro-batch in this stage.
        held: micro-batches whose saved bytes it holds at once under the schedule.
        send_bytes: the activation it sends to the next stage (0 for the last).
        send_time: seconds to send it, given a bandwidth (else 0).
        loss: seconds of the loss's forward and backward, run by the last stage
            (else 0); not in ``forward``/``backward``, which are the layers'.
    """

    first: int
    last: int
    types: tuple[str, ...]
    forward: float
    backward: float
    share: float
    param_bytes: int
    saved_bytes: int
    held: float
    send_bytes: int
    send_time: float = 0.0
    loss: float = 0.0

    @property
    def time(self) -> float:
        """Forward plus backward seconds."""
        return self.forward + self.backward

    @property
    def cost(self) -> float:
        """What ``balance`` weighs: forward, backward, the send and the loss, in seconds."""
        return self.time + self.send_time + self.loss

    @property
    def activation_memory(self) -> float:
        """Saved bytes times the micro-batches held at once."""
        return self.saved_bytes * self.held

    @property
    def memory(self) -> float:
        """Parameters with their gradients, plus the held activations."""
        return 2 * self.param_bytes + self.activation_memory


@dataclass(frozen=True)
class CutReport:
    """A cut, its stages and its predicted step under a schedule."""

    balance: tuple[int, ...]
    stages: tuple[StageReport, ...]
    timeline: Timeline
    schedule: str
    microbatches: int

    @property
    def imbalance(self) -> float:
        """Slowest stage cost over the mean stage cost (1.0 is perfect)."""
        times = [stage.cost for stage in self.stages]
        mean = sum(times) / len(times)
        return max(times) / mean if mean > 0 else 1.0

    @property
    def step_time(self) -> float:
        return self.timeline.makespan

    @property
    def bubble_fraction(self) -> float:
        return self.timeline.bubble_fraction


def report(
    costs: Sequence[LayerCost],
    sizes: Sequence[int],
    held: Sequence[float],
    schedule: str,
    microbatches: int,
    bandwidth: float | None = None,
    loss: LossCost | None = None,
    link: Link | None = None,
    timetable: Schedule | None = None,
) -> CutReport:
    """Summarise the cut ``sizes`` of ``costs`` and simulate it under ``schedule``.

    With ``bandwidth``, each stage but the last also costs its send time, as in
    ``balance``; in the simulation every cross-stage transfer takes the largest
    boundary activation's send time (a conservative single figure). The last
    stage also runs ``loss`` (None: the loss of a Profile measured with a
    ``loss_fn``), its forward after the last layer's, its backward before. With
    ``link`` (e.g. ``calibrated_link``) every transfer also takes its latency plus the
    largest boundary activation over its bandwidth. ``timetable``: the schedule already
    built (``get_schedule(schedule, len(sizes), microbatches)``), for a caller that
    reports many cuts.
    """
    if loss is None and isinstance(costs, Profile):
        loss = costs.loss
    total = sum(cost.time for cost in costs) or 1.0
    stages, start = [], 0
    for stage, size in enumerate(sizes):
        layers = costs[start : start + size]
        last = stage == len(sizes) - 1
        stages.append(
            StageReport(
                first=start,
                last=start + size - 1,
                types=tuple(cost.name or "?" for cost in layers),
                forward=sum(cost.forward for cost in layers),
                backward=sum(cost.backward for cost in layers),
                share=sum(cost.time for cost in layers) / total,
                param_bytes=sum(cost.param_bytes for cost in layers),
                saved_bytes=saved_bytes_of(layers)
                + (loss.saved_bytes if last and loss is not None else 0),
                held=held[stage],
                send_bytes=0 if last else layers[-1].activation_bytes,
                send_time=0.0 if last or not bandwidth else layers[-1].activation_bytes / bandwidth,
                loss=loss.time if last and loss is not None else 0.0,
            )
        )
        start += size
    comm = max(stage.send_time for stage in stages)
    if link is not None:
        comm += link(0, 1, max(stage.send_bytes for stage in stages))
    forward = [stage.forward for stage in stages]
    backward = [stage.backward for stage in stages]
    if loss is not None:
        forward[-1] += loss.forward
        backward[-1] += loss.backward
    if timetable is None:
        timetable = get_schedule(schedule, len(sizes), microbatches)
    timeline = simulate(
        timetable,
        forward=forward,
        backward=backward,
        comm=comm,
    )
    return CutReport(tuple(sizes), tuple(stages), timeline, schedule, microbatches)


def calibrated_link(device: Any = "cpu", rounds: int = 9) -> Link:
    """A hop measured in this process: a copy of 64 B and of 1 MiB on ``device``.

    Between stages of one host a result crosses as a copy (threads) or through
    loopback; this times the copy (``Tensor.clone``, synchronised on CUDA), the
    fastest of ``rounds`` after one untimed (other load only slows a copy), and fits
    ``latency + bytes / bandwidth``.

    Returns:
        ``Link`` with latency > 0 and a finite bandwidth.
    """
    import time

    import torch

    from partitioners.measure.timing import synchronize

    target = torch.device(device)
    found = []
    for nbytes in (64, 1 << 20):
        source = torch.zeros(nbytes, dtype=torch.uint8, device=target)
        times = []
        for _ in range(rounds + 1):
            synchronize(target)
            start = time.perf_counter()
            source.clone()
            synchronize(target)
            times.append(time.perf_counter() - start)
        found.append(min(times[1:]))
    slope = max(found[1] - found[0], ((1 << 20) - 64) / 1e13)
    bandwidth = ((1 << 20) - 64) / slope
    return Link(max(found[0] - 64 / bandwidth, 1e-9), bandwidth)


def layer_types(types: Sequence[str], width: int = 30) -> str:
    """Layers' names, runs compressed, cut to ``width`` characters.

    ``("Linear", "ReLU", "ReLU")`` -> ``"Linear, ReLU x2"``; a traced model's units
    ``("(prologue)", "model.layers.0", "model.layers.1")`` -> ``"(prologue), model.layers.0-1"``.
    """
    runs: list[list[str]] = []
    for name in types:
        if runs and _continues(runs[-1], name):
            runs[-1].append(name)
        else:
            runs.append([name])
    text = ", ".join(_run_text(run) for run in runs)
    return text if len(text) <= width else text[: width - 3] + "..."


_NUMBERED = re.compile(r"^(.*\.)(\d+)$")


def _numbered(name: str) -> tuple[str, int] | None:
    """``"model.layers.3"`` -> ``("model.layers.", 3)``; None for a name without an index."""
    match = _NUMBERED.match(name)
    return (match.group(1), int(match.group(2))) if match else None


def _follows(previous: str, name: str) -> bool:
    """``"model.layers.4"`` follows ``"model.layers.3"``."""
    before, after = _numbered(previous), _numbered(name)
    return (before is not None and after is not None and before[0] == after[0]
            and after[1] == before[1] + 1)


def _continues(run: list[str], name: str) -> bool:
    """Whether ``name`` extends ``run``: a repeat of one name, or the next numbered block."""
    if len(run) == 1:
        return name == run[0] or _follows(run[0], name)
    if run[0] == run[1]:
        return name == run[-1]
    return _follows(run[-1], name)


def _run_text(run: list[str]) -> str:
    """``["h.1"]`` -> ``"h.1"``; ``["ReLU", "ReLU"]`` -> ``"ReLU x2"``; ``["h.1", "h.2"]`` ->
    ``"h.1-2"``."""
    if len(run) == 1:
        return run[0]
    if run[0] == run[1]:
        return f"{run[0]} x{len(run)}"
    return f"{run[0]}-{run[-1].rsplit('.', 1)[1]}"


def stage_table(cut: CutReport) -> str:
    """The per-stage table, one row per stage and a total row; send times if there are any."""
    timed_sends = any(stage.send_time for stage in cut.stages)
    header = (
        f"{'stage':>5}  {'layers':<9} {'types':<30} {'fwd ms':>9} {'bwd ms':>9} {'share':>6}"
        f"  {'params':>10}  {'act. memory':>11}  {'sends':>10}"
    ) + (f" {'send ms':>9}" if timed_sends else "")
    lines = [header, "-" * len(header)]
    for index, stage in enumerate(cut.stages):
        span = f"{stage.first}-{stage.last}" if stage.last > stage.first else f"{stage.first}"
        sends = format_bytes(stage.send_bytes) if stage.send_bytes else "-"
        row = (
            f"{index:>5}  {span:<9} {layer_types(stage.types):<30} {stage.forward * 1e3:>9.3f} "
            f"{stage.backward * 1e3:>9.3f} {stage.share:>6.1%}  "
            f"{format_bytes(stage.param_bytes):>10}"
            f"  {format_bytes(stage.activation_memory):>11}  {sends:>10}"
        )
        if timed_sends:
            row += f" {stage.send_time * 1e3:>9.3f}" if stage.send_bytes else f" {'-':>9}"
        lines.append(row)
    forward = sum(stage.forward for stage in cut.stages)
    backward = sum(stage.backward for stage in cut.stages)
    params = sum(stage.param_bytes for stage in cut.stages)
    lines.append("-" * len(header))
    lines.append(
        f"{'total':>5}  {'':<9} {'':<30} {forward * 1e3:>9.3f} {backward * 1e3:>9.3f} "
        f"{1:>6.1%}  {format_bytes(params):>10}"
    )
    if cut.stages[-1].loss:
        lines.append(
            f"(stage {len(cut.stages) - 1} also runs the loss: "
            f"{cut.stages[-1].loss * 1e3:.3f} ms forward and backward)"
        )
    return "\n".join(lines)


def comparison_table(chosen: CutReport, uniform: CutReport, label: str) -> str:
    """The chosen cut beside the uniform one: imbalance, predicted step time and bubble."""
    rows = [
        ("balance", str(list(chosen.balance)), str(list(uniform.balance))),
        ("slowest stage", _ms(_slowest(chosen)), _ms(_slowest(uniform))),
        ("imbalance", f"{chosen.imbalance:.3f}", f"{uniform.imbalance:.3f}"),
        ("step time", _ms(chosen.step_time), _ms(uniform.step_time)),
        ("bubble", f"{chosen.bubble_fraction:.1%}", f"{uniform.bubble_fraction:.1%}"),
        (
            "peak memory",
            format_bytes(max(s.memory for s in chosen.stages)),
            format_bytes(max(s.memory for s in uniform.stages)),
        ),
    ]
    width = max(len(label), *(len(row[1]) for row in rows)) + 2
    lines = [f"{'':<15}{label:<{width}}uniform"]
    lines += [f"{name:<15}{mine:<{width}}{theirs}" for name, mine, theirs in rows]
    lines.append(
        f"(predicted by schedules.simulate: {chosen.schedule}, "
        f"{chosen.microbatches} micro-batches; "
        f"imbalance = slowest / mean stage; memory = 2 x params + saved x held)"
    )
    return "\n".join(lines)


def _slowest(cut: CutReport) -> float:
    return max(stage.cost for stage in cut.stages)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def to_data(cut: CutReport) -> dict[str, Any]:
    """The cut as JSON-ready data, ``balance`` first."""
    return {
        "balance": list(cut.balance),
        "stages": [
            {
                "stage": index,
                "layers": [stage.first, stage.last],
                "types": list(stage.types),
                "forward_ms": stage.forward * 1e3,
                "backward_ms": stage.backward * 1e3,
                "share": stage.share,
                "param_bytes": stage.param_bytes,
                "saved_bytes": stage.saved_bytes,
                "held_microbatches": stage.held,
                "activation_memory_bytes": stage.activation_memory,
                "memory_bytes": stage.memory,
                "send_bytes": stage.send_bytes,
                "send_ms": stage.send_time * 1e3,
                "loss_ms": stage.loss * 1e3,
            }
            for index, stage in enumerate(cut.stages)
        ],
        "imbalance": cut.imbalance,
        "predicted": {
            "schedule": cut.schedule,
            "microbatches": cut.microbatches,
            "step_time_ms": cut.step_time * 1e3,
            "bubble_fraction": cut.bubble_fraction,
        },
    }
