"""One stage per rank: run a schedule over a torch.distributed process group."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from schedules import Event, Schedule, Timeline

from pipeline.compute.activations import ActivationTracker, MemoryReport
from pipeline.compute.shared import chunk_layers, shared_parameters, unique
from pipeline.compute.slicing import build_chunks
from pipeline.compute.tied_hooks import SharedGrads, chunk_users, refuse_hooks_across_ranks
from pipeline.group.collectives import all_reduce, barrier
from pipeline.compute.recompute import step_seed
from pipeline.group.process_groups import clock_offset
from pipeline.runtime.data_parallel import Alone, DataParallel, Sharding, local_part
from pipeline.runtime.grad_norm import clip_spread_grads
from pipeline.runtime.executor import StageResult, StepInputs, StepMeter, run_stage
from pipeline.runtime.remote_layers import free_remote_layers, shared_across_stages
from pipeline.runtime.step_state import StepState
from pipeline.runtime.step_times import StepTimes
from pipeline.runtime.expert_parallel import ExpertSplit, expert_parameters, unmatched_pairs
from pipeline.runtime.paired import while_in_flight
from pipeline.runtime.tensor_parallel import TensorSplit, send_shards
from pipeline.runtime.rank_share import rank_share
from pipeline.runtime.runner import PendingTimeline, propagate_input_grads, step_of
from pipeline.compute.chunk import ChunkOptions, ChunkRunner, ChunkSpec
from pipeline.compute.dtensors import is_dtensor
from pipeline.errors import PeerError
from pipeline.transports import TransportName, make_transport
from pipeline.transports.wire import call_stamp


def _materialise(layers: nn.Sequential, device: torch.device,
                 init_fn: Callable[[nn.Module], None] | None) -> None:
    on_meta = any(t.is_meta for t in list(layers.parameters()) + list(layers.buffers()))
    if not on_meta:
        layers.to(device)
        return
    layers.to_empty(device=device)
    for layer in layers:
        if init_fn is not None:
            init_fn(layer)
            continue
        for module in layer.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()


class DistRunner:
    """This rank's stage: its chunks, its transport, and the step's collectives."""

    def __init__(
        self,
        model: nn.Sequential,
        balance: Sequence[int],
        schedule: Schedule,
        device: torch.device,
        options: ChunkOptions,
        timeout: float,
        group: dist.ProcessGroup,
        init_fn: Callable[[nn.Module], None] | None,
        transport: TransportName = "auto",
        data_parallel: DataParallel | None = None,
        tensor_parallel: TensorSplit | None = None,
        expert_parallel: ExpertSplit | None = None,
    ) -> None:
        self.group = group
        self.data_parallel = data_parallel if data_parallel is not None else Alone()
        self.tp_mesh = tensor_parallel.mesh if tensor_parallel is not None else None
        self.boundaries: Any = None  # a traced cut's tensor-parallel all-reduces, counted
        self.exchange: Any = None  # its expert-parallel all-to-alls, counted
        self.schedule = schedule
        self.device = device
        self.stage = dist.get_rank(group)
        self.stage_ranks = [dist.get_global_rank(group, r) for r in range(schedule.stages)]
        self.balance = list(balance)
        self.model = model
        self.layers_of = chunk_layers(balance)
        self.local_layers = [i for c in schedule.chunks_of_stage[self.stage]
                             for i in self.layers_of[c]]
        self._hold_layers(init_fn, tensor_parallel, expert_parallel)
        share = 1.0 / len(schedule.chunks_of_stage[self.stage])
        self.tracker = ActivationTracker(self.parameters(), share)
        self.trackers: tuple[ActivationTracker, ...] = (self.tracker,)

        local_chunks = schedule.chunks_of_stage[self.stage]
        self.shared_grads = SharedGrads(chunk_users(model, balance, local_chunks))

        def make_chunk(spec: ChunkSpec, layers: nn.Sequential, chunk_device: torch.device
                       ) -> ChunkRunner:
            return ChunkRunner(spec, layers, chunk_device, options, self.tracker, None,
                               self.shared_grads, sharded=self.data_parallel.sharding.sharded)

        devices = [device] * schedule.stages
        self.chunks = build_chunks(model, balance, schedule, devices, [self.stage], make_chunk)
        self.timeout = timeout
        # This stage's steps only: the whole plans are derived, proven and dropped there.
        self.share = rank_share(schedule, self.stage)
        self.transport = make_transport(
            transport, group, self.stage_ranks, self.stage, device, schedule.chunks,
            list(self.share.channels), timeout,
        )
        self.clock_offset = clock_offset(group, timeout, device)
        self.times = StepTimes(schedule, self.stage, group, device, timeout, self.clock_offset)
        self.memory: tuple[MemoryReport, ...] = ()
        self._broken: str | None = None  # why this rank's group can no longer be used
        self.meter: StepMeter | None = None  # set one to account for each step's time
        self._calls = 0  # step() and pipe(x) calls, counted alike on every rank

    def _hold_layers(self, init_fn: Callable[[nn.Module], None] | None,
                     tensor_parallel: TensorSplit | None,
                     expert_parallel: ExpertSplit | None = None) -> None:
        """This rank's layers materialised, split and sharded, the rest freed; the shared
        parameters to sum after each step (``synced``) and those this rank counts when
        clipping (``counted``), as they are after the split."""
        model, schedule = self.model, self.schedule
        for split in (tensor_parallel, expert_parallel):  # refused before any layer is freed
            if split is not None:
                split.check()
        self.shared = shared_parameters(model)
        synced, owner_stage = shared_across_stages(model, self.balance, schedule,
                                                   self.local_layers, self.shared)
        free_remote_layers(model, self.local_layers, self.shared)
        for c in schedule.chunks_of_stage[self.stage]:
            _materialise(nn.Sequential(*[model[i] for i in self.layers_of[c]]), self.device,
                         init_fn)
        now = self._split_layers(tensor_parallel, expert_parallel)
        self.synced = [replace(entry, parameter=None if entry.parameter is None
                               else now[id(entry.parameter)]) for entry in synced]
        owner_stage = {id(now[key]): stage for key, stage in owner_stage.items() if key in now}
        self.counted = [
            p for p in self.parameters() if owner_stage.get(id(p), self.stage) == self.stage
        ]

    def _split_layers(self, tensor_parallel: TensorSplit | None,
                      expert_parallel: ExpertSplit | None = None) -> dict[int, nn.Parameter]:
        """Parallelize the local layers over ``tp`` (the user's ``fn(layer, tp_mesh)``), then
        let the data-parallel replicas shard them: ``id`` of each parameter before -> the
        parameter that replaced it (itself where nothing did)."""
        paths = {id(p): (index, name) for index in self.local_layers
                 for name, p in self.model[index].named_parameters()}
        if tensor_parallel is not None:
            self.boundaries = tensor_parallel.apply(self.local_layers)
            send_shards([self.model[layers[-1]] for c in self.schedule.chunks_of_stage[self.stage]
                         if c != self.schedule.chunks - 1 and (layers := self.layers_of[c])])
        if expert_parallel is not None:
            self.exchange = expert_parallel.apply(self.local_layers)
            self.exchange.in_flight = while_in_flight
            self._warn_unmatched_pairs()
        self.data_parallel.shard([self.model[index] for index in self.local_layers])
        return {key: self.model[index].get_parameter(name) for key, (index, name) in paths.items()}

    def _warn_unmatched_pairs(self) -> None:
        experts = {c: expert_parameters([self.model[i] for i in self.layers_of[c]])
                   for c in self.schedule.chunks_of_stage[self.stage]}
        for forward, backward, mine, theirs in unmatched_pairs(self.schedule, self.stage,
                                                               experts):
            warnings.warn(
                f"stage {self.stage}: overlapped pairs run chunk {forward}'s forward ({mine} "
                f"expert parameters) with chunk {backward}'s backward ({theirs}): the side "
                f"with more exchanges waits its surplus in full. Cut the model so that "
                f"paired chunks hold as many MoE layers (Pipe(balance=...))", stacklevel=2)

    @property
    def sharding(self) -> Sharding:
        return self.data_parallel.sharding

    def parameters(self) -> Iterator[nn.Parameter]:
        yield from unique(p for index in self.local_layers for p in self.model[index].parameters())

    def _fail(self, error: BaseException) -> None:
        origin = error.rank if isinstance(error, PeerError) and error.rank is not None \
            else dist.get_rank()
        self.transport.fail(origin, f"{type(error).__name__}: {error}")
        if isinstance(error, PeerError):
            self._broken = self._broken or str(error)
            self.times.halted = True

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise PeerError(
                f"this pipeline's process group failed in an earlier step ({self._broken}); "
                f"messages of that step may still be in flight, so the group cannot be reused: "
                f"call pipe.close(), destroy the process group and build a new one and a new Pipe"
            )

    def _run(self, step_inputs: StepInputs, infer: bool) -> StageResult:
        self._check_usable()
        meter = None if infer else self.meter
        plan = self.share.steps(infer)
        beginning = time.perf_counter()
        self._calls += 1
        self.transport.begin_step(plan.comm, self.stage, call_stamp(self._calls, not infer))
        if meter is not None:  # posting the first receives
            meter.post += time.perf_counter() - beginning
        try:
            result = run_stage(plan, self.chunks, self.transport, step_inputs, infer=infer,
                               meter=meter, carry_loss=None if infer else self.device)
            finishing = time.perf_counter()
            self.transport.finish()
            if meter is not None:
                meter.wait += time.perf_counter() - finishing
        except BaseException as error:
            self._fail(error)
            raise
        return result

    def run_step(
        self, inputs: list[Any] | None, targets: list[Any] | None, weights: list[float] | None
    ) -> tuple[torch.Tensor, PendingTimeline]:
        refuse_hooks_across_ranks([synced.parameter for synced in self.synced], self._names())
        state = StepState.set_aside(self.parameters(), self.chunks_modules())
        self.shared_grads.begin_step()
        try:
            self.data_parallel.begin_step()
            found = self._step(inputs, targets, weights)
            self.shared_grads.end_step(succeeded=True)
        except BaseException as error:
            self.shared_grads.end_step(succeeded=False)
            self.data_parallel.abandon_step()
            state.restore(error)
            if isinstance(error, PeerError):
                # Messages of this step may still be in flight: the group must not be reused.
                self._broken = self._broken or str(error)
                self.times.halted = True
            raise
        state.merge()
        return found

    def _names(self) -> dict[int, str]:
        """``id`` of each local parameter -> its key (for messages)."""
        return {id(p): f"{index}.{name}" for index in self.local_layers
                for name, p in self.model[index].named_parameters()}

    def chunks_modules(self) -> list[nn.Module]:
        """This rank's chunks' layers."""
        return [chunk.layers for chunk in self.chunks.values()]

    def _step(
        self, inputs: list[Any] | None, targets: list[Any] | None, weights: list[float] | None
    ) -> tuple[torch.Tensor, PendingTimeline]:
        schedule = self.schedule
        if self.tracker.measuring:
            self.tracker.reset_peaks()
        step_inputs = StepInputs.on(inputs, targets, weights, schedule, self.device, self.device)
        origin = time.perf_counter()  # no barrier: ranks wait for each other's messages anyway
        with step_of(self.chunks.values(), schedule, self._step_seed()):
            result = self._run(step_inputs, infer=False)
        propagate_input_grads(step_inputs.inputs, [result])
        if self.tracker.measuring:
            self.memory = (self.tracker.report(),)
        shared = time.perf_counter()
        loss = self._batch_loss(result.loss_known)
        timeline = self.times.record(result.events, origin)  # gathered when asked for
        self.data_parallel.reduce_gradients(list(self.parameters()))
        self._sum_shared_gradients()
        self.data_parallel.average_loss(loss)
        if self.meter is not None:
            end = time.perf_counter()
            self.meter.collective += end - shared
            self.meter.total += end - origin
            self.meter.steps += 1
        return loss, timeline

    def _batch_loss(self, known: torch.Tensor | None) -> torch.Tensor:
        """The batch loss the backward messages brought (``executor.LossCarrier``)."""
        microbatches = self.schedule.microbatches
        counted = 0 if known is None else int(known[0])
        if counted != microbatches:
            raise RuntimeError(
                f"stage {self.stage} learned the losses of {counted} of {microbatches} "
                f"micro-batches from the backward messages; the schedule should bring all"
            )
        assert known is not None
        return known[1].clone()

    def _sum_shared_gradients(self) -> None:
        """Every stage holding a shared parameter ends with its full gradient: the sum."""
        for synced in self.synced:
            parameter = synced.parameter
            if parameter is not None and parameter.grad is not None:
                all_reduce(local_part(parameter.grad), self.group, self.timeout,
                           "summing a shared parameter's gradient")
                continue
            shape = self.data_parallel.local_shape(synced.shape)
            grad = torch.zeros(shape, dtype=synced.dtype, device=self.device)
            all_reduce(grad, self.group, self.timeout, "summing a shared parameter's gradient")
            if parameter is not None:
                parameter.grad = _like(parameter, grad)

    def recent_timelines(self) -> tuple[Timeline, ...]:
        """The last steps' whole Timelines on the first rank, oldest first (empty on the
        others): every rank calls it, and it gathers what no read gathered yet
        (``step_times``)."""
        return self.times.recent()

    def run_forward(self, inputs: list[Any] | None) -> list[Any] | None:
        schedule = self.schedule
        step_inputs = StepInputs.on(inputs, None, None, schedule, self.device, None)
        self.data_parallel.begin_forward_only()
        try:
            with step_of(self.chunks.values(), schedule, self._step_seed()), torch.no_grad():
                result = self._run(step_inputs, infer=True)
        finally:
            self.data_parallel.after_forward_only()
        if self.stage != schedule.placement[-1]:
            return None
        return [result.outputs[m] for m in range(schedule.microbatches)]

    def release(self) -> None:
        """Release the transport's communicators and buffers without waiting for the others
        (a dropped Pipe's finalizer)."""
        self._broken = self._broken or "released"
        self.times.halted = True
        self.transport.close()
        self._close_chunks()

    def close(self) -> None:
        """Let every rank arrive (sending the first rank the timelines no read gathered, so
        that ``pipe.timeline`` still holds the last step's), then release the transport's
        communicators and buffers."""
        if self._broken is None:
            try:
                self.times.gather()
                barrier(self.group, self.timeout, "closing the pipeline")
            except PeerError:
                pass
        self.times.halted = True
        self.transport.close()
        self._close_chunks()

    def _close_chunks(self) -> None:
        for chunk in self.chunks.values():
            chunk.close()

    def _step_seed(self) -> int | None:
        """With tensor parallelism, one step seed for the stage's tp ranks (each draws one,
        the largest is kept), so that a region every rank computes whole draws the same
        numbers on each (their values must agree); else None (each draws its own)."""
        if self.tp_mesh is None:
            return None
        seed = torch.tensor([step_seed()], dtype=torch.int64, device=self.device)
        all_reduce(seed, self.tp_mesh.get_group(), self.timeout, "agreeing on the step's seed",
                   dist.ReduceOp.MAX)
        return int(seed.item())

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The global norm over every rank's part of the gradients (``grad_norm``)."""
        groups = {"pp": self.group, **self.data_parallel.norm_groups,
                  "tp": self.tp_mesh.get_group() if self.tp_mesh else None}
        return clip_spread_grads([p.grad for p in self.parameters() if p.grad is not None],
                                 [p.grad for p in self.counted if p.grad is not None], groups,
                                 max_norm, norm_type, self.timeout, self.device)


def _like(parameter: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient of ``parameter``: a DTensor shard where it is one."""
    if is_dtensor(parameter):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, parameter.device_mesh, parameter.placements,
                                  shape=parameter.shape, stride=parameter.stride())
    return local
