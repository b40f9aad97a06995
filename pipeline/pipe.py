"""Pipe: the user-facing wrapper that runs a model, cut into units, as a pipeline of stages."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from partitioners.measure.model_cut import cut_of
from schedules import Schedule, Timeline
from schedules.recompute import CheckpointMode
from split_backward import SplitMode
from split_backward import check_mode as check_split_mode
from units import Cut

from pipeline.compute.chunk import ChunkOptions
from pipeline.compute.loss import SummedLoss, loss_rule
from pipeline.compute.microbatch import merge, split, split_batch
from pipeline.compute.own_loss import check_labels_on_last, own_loss_rule, own_loss_target
from pipeline.compute.sample import split_sample
from pipeline.group.distributed import Distributed, layout_of
from pipeline.group.ranks import RankGroup, Ranks
from pipeline.model_like import ModelLike
from pipeline.pipe_views import PipeViews
from pipeline.runtime.build import processes
from pipeline.runtime.one_call import OneCall
from pipeline.runtime.runner import PendingTimeline, Runner
from pipeline.setup.balancing import resolve_balance
from pipeline.setup.options import build_schedule, check_model
from pipeline.setup.picking import Requested, pick

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh



class Pipe(PipeViews, ModelLike):
    """Run ``model`` as a pipeline: its layers cut into stages, micro-batches in a schedule.

    In one process each stage is a thread on its own device. With ``group=`` (or
    ``distributed=Distributed(group, ...)``, or ``mesh=``) rank r of the process group runs
    stage r.

    Args:
        model: an ``nn.Sequential`` (its layers are the units cut into stages), or any
            other ``nn.Module``, traced with ``sample`` and cut into units (``pipe.units``):
            the prologue, each block of its main run of same-class blocks, the
            epilogue. Either way it becomes a ``units.Cut`` (``pipe.cut``), whose keys are
            the model's own. Its modules are moved to the stages' devices in place, so
            ``model.state_dict()`` keeps its keys and tensors, and its parameters are the
            ones that train. ``pipe.model`` is the ``nn.Sequential`` that runs
            (``pipe.cut.units``); ``pipe.source_model`` the model given.
        chunks: micro-batches per step (torchgpipe's name for them), or ``"auto"``.
            With ``chunks="auto"`` or ``schedule="auto"``, ``partitioners.plan_for_model``
            profiles ``sample`` and picks the fastest predicted schedule, micro-batch
            count, cut and checkpoint mode that fits ``memory_limit`` (rank 0 plans, every
            rank runs its plan); ``pipe.plan`` holds the pick and every candidate.
        balance: layers per model chunk (stages x chunks-per-stage entries), or
            ``"time"`` / ``"params"`` / ``"uniform"``, or None for uniform.
        devices: one device per stage (one process only); default: CUDA devices
            round-robin, else the CPU.
        schedule: a name known to ``schedules.get_schedule`` or a ``Schedule``.
        checkpoint: ``"always"``, ``"except_last"`` (the default) or ``"never"``
            recomputation; ``"auto"`` (the default when planning) lets the plan choose.
        loss_fn: ``loss_fn(output, target)`` per micro-batch; needed by ``step``. The
            micro-batch losses add up to exactly the whole batch's loss (see
            ``pipeline.compute.loss``): torch's loss modules are normalised by the batch's count
            (rows, elements, or the weighted non-ignored targets of a cross-entropy);
            another callable's results are weighted by their share of the rows; a
            ``SummedLoss(fn, count)`` returns a micro-batch's *sum* and ``count(target)``
            what it counts (e.g. its non-padding tokens): the step's loss is then the sum
            of sums over the sum of counts.
        deferred_batch_norm: BatchNorm running statistics updated once per step, as one
            forward of the whole batch would (else once per micro-batch).
        memory_limit: bytes per stage a plan must fit in (with ``"auto"``).
        sample: an input batch to profile when ``balance="time"`` (else the first batch);
            for a model that is not an ``nn.Sequential``, the batch it is traced with
            (required, on every rank). ``Sample(inputs, target)`` adds its target: with
            ``"auto"``, the loss's time and the memory it keeps count in the plan.
        group: the process group whose rank r runs stage r: ``Distributed(group)``.
        mesh: a ``DeviceMesh`` with dimensions named ``"pp"`` (the pipeline) and optionally
            ``"dp"`` (data-parallel replicas): ``Distributed.from_mesh(mesh)``.
        distributed: the whole process layout (``pipeline.Distributed``: the process group,
            a data-parallel group and how it shares a stage (``data_parallel``,
            ``reshard_after_forward``), ``tensor_parallel``, the transport, ``init_fn``);
            ``Distributed.from_mesh(mesh, ...)`` for a mesh with options. One of
            ``group``, ``mesh`` and ``distributed``; none: one process.
        stages: number of stages, when neither devices, group nor a Schedule says it.
        schedule_options: extra arguments for the schedule generator
            (``chunks_per_stage`` for interleaved 1F1B).
        timeout: seconds a stage waits for a peer before failing.
        units: for a traced model, the module names (as in ``model.named_modules()``)
            where units begin, in the order the forward runs them, instead of the default
            cut; what runs before the first is a unit of its own.
        split_backward: how a zero-bubble schedule splits a backward into I and W:
            ``"auto"`` (weight gradients of large Linear layers deferred by the layers,
            the graph split elsewhere), ``"layers"`` or ``"graph"``.
    """

    def __init__(
        self,
        model: nn.Module,
        chunks: int | Literal["auto"],
        balance: Sequence[int] | str | None = None,
        devices: Sequence[torch.device | str | int] | None = None,
        schedule: str | Schedule = "1f1b",
        checkpoint: CheckpointMode | Literal["auto"] | None = None,
        loss_fn: Callable[..., torch.Tensor] | SummedLoss | None = None,
        sample: Any = None,
        *,
        group: ProcessGroup | None = None,
        mesh: DeviceMesh | None = None,
        distributed: Distributed | None = None,
        stages: int | None = None,
        schedule_options: dict[str, Any] | None = None,
        timeout: float = 60.0,
        deferred_batch_norm: bool = False,
        memory_limit: float | None = None,
        units: Sequence[str] | None = None,
        split_backward: SplitMode = "auto",
    ) -> None:
        settings = layout_of(distributed, mesh, group)
        self._processes = processes(settings, timeout)  # one process or a group: decided here
        self._ranks: Ranks = self._processes.ranks
        # First, before anything that could raise on some ranks only.
        inputs, target = split_sample(sample)
        self._ranks.check_agree(chunks=chunks, schedule=schedule, balance=balance,
                                checkpoint=checkpoint, stages=stages,
                                schedule_options=schedule_options,
                                traced_sample=None if isinstance(model, nn.Sequential) else inputs)
        self.source_model = check_model(model)
        self.cut: Cut = cut_of(self.source_model, inputs, units,  # what every model becomes
                               settings.expert_parallel if settings is not None else None)
        self.model = self.cut.units
        self.cut.ties  # noqa: B018 - read while every rank still holds every layer
        self.timeout, self._closed, self._distributed = timeout, False, settings
        self._split_backward = check_split_mode(split_backward)
        self._one_call = OneCall()  # step, pipe(x), predict and close: one at a time
        self._measuring = 0  # measure_memory() blocks entered and not left
        picked = pick(Requested(chunks, schedule, balance, checkpoint, devices, stages,
                                schedule_options, memory_limit),
                      self._processes, self.cut, (inputs, target, loss_fn), self._deciders,
                      settings, timeout, self._split_backward)
        self._stage_source, self._devices, self._plan = picked.source, picked.devices, picked.plan
        self.chunks, self.checkpoint = picked.chunks, picked.checkpoint
        self.loss_fn = loss_fn  # None with labels in a traced sample: the model's own loss
        self._loss_rule = loss_rule(loss_fn) or own_loss_rule(
            self.source_model, self.cut.takes_batch_as_written, inputs)
        self.cut.check_options(deferred_batch_norm)
        self._options = ChunkOptions(
            self.checkpoint, self._loss_rule.function if self._loss_rule is not None else None,
            bool(deferred_batch_norm), self._split_backward)
        self._schedule = build_schedule(picked.schedule, picked.stages, self.chunks,
                                        picked.options)
        self._balance_request = picked.balance
        self._balance = self._resolve_balance(inputs)
        self._forget_steps(runner=None)
        if self._balance is not None:
            self._build_runner()

    # -- construction ---------------------------------------------------------------------

    def _forget_steps(self, runner: Runner | None) -> None:
        self._runner: Runner | None = runner
        self._timeline: Timeline | None = None
        self._pending: PendingTimeline | None = None  # the last step's, until read

    @property
    def _deciders(self) -> Ranks:
        """Who takes one decision for all: in a mesh the replicas and tensor-parallel ranks
        of a stage must run one cut, so the first rank of the whole mesh decides."""
        settings = self._distributed
        if settings is None or settings.holders is settings.group:
            return self._ranks
        return RankGroup(settings.holders, self.timeout)

    def _build_runner(self) -> Runner:
        assert self._balance is not None
        self._pending = None
        runner = self._processes.build_runner(self.cut, self._balance, self._schedule,
                                              self._devices, self._options)
        self._runner = runner
        # A Pipe dropped without close() still gives back its communicators and buffers
        # (locally: a finalizer cannot wait for the other ranks).
        self._release = weakref.finalize(self, runner.release)
        self._set_measuring()
        return runner

    def _resolve_balance(self, sample: Any) -> list[int] | None:
        def resolve() -> list[int] | None:
            try:
                return resolve_balance(
                    self._balance_request, self.model, self._schedule.chunks, sample,
                    self._schedule.name, self.chunks,
                )
            except ValueError as error:
                raise ValueError(f"{error} ({self._stage_source})") from None

        if not isinstance(self._balance_request, str):
            return resolve()
        # Measured balances differ from rank to rank: the first rank's is everyone's.
        return self._deciders.decide(resolve, "balance")

    def _ensure_runner(self, sample: Any) -> Runner:
        """The runner, built first where a 'time' balance waited for a batch."""
        if self._closed:
            raise RuntimeError("this Pipe was closed; build a new one")
        if self._runner is None:
            first = sample[0] if isinstance(sample, list) else sample
            self._balance = self._resolve_balance(first)
            if self._balance is None:
                raise ValueError("balance='time' needs a sample: pass sample=... or a batch")
            return self._build_runner()
        return self._runner

    # -- running --------------------------------------------------------------------------

    def step(self, x: Any, target: Any = None, *, scaler: Any = None) -> torch.Tensor:
        """One training step: every forward and backward in the schedule's order.

        Gradients accumulate into the model's parameters, as ``backward()`` would. With
        data-parallel replicas the step is the one of the union of the replicas' batches:
        each micro-batch's loss is divided by the union's count (the rows, elements or
        non-ignored targets the loss's mean divides by; a sum loss adds up), so that the
        averaged gradients and the returned loss are the whole batch's.

        Args:
            x: the batch (a tensor, a tuple of tensors, or a list of pre-split
                micro-batches; for a traced model, the batch as the model takes it: a
                tensor, a tuple of positional arguments, or a dict of keyword arguments).
                With a group, only the rank holding the first chunk reads it.
            target: the targets, split the same way; read where the last chunk runs.
                None (left out) with the model's own loss: no ``loss_fn``, a traced model
                and ``labels`` in the batch (``pipeline.compute.own_loss``).
            scaler: a ``torch.amp.GradScaler``: the loss is scaled by its scale before the
                backward, as ``scaler.scale(loss).backward()`` would; then call
                ``scaler.step(optimizer)`` and ``scaler.update()`` as usual. With a group,
                an overflow on any rank is made visible on every rank, so that all of them
                skip the same step.

        Returns:
            The batch loss, detached and unscaled (on every rank with a group).

        Raises:
            ValueError: no loss_fn, or a batch with fewer rows than micro-batches.
            StageError: a layer failed; the message names the stage, layer and micro-batch.
        """
        with self._one_call("pipe.step()"):
            return self._step(x, target, scaler)

    def _step(self, x: Any, target: Any, scaler: Any) -> torch.Tensor:
        if self._loss_rule is None:
            raise ValueError("step() needs a loss_fn: build the Pipe with loss_fn=nn.MSELoss() or "
                             "similar, or trace it with labels in the sample (the model's own loss)")
        if self.loss_fn is None and target is None:
            target = own_loss_target(x, self._ranks.size == 1)
        self.cut.check_model()
        if x is not None:
            self.cut.check_batch(x)
        inputs, targets = split_batch(x, target, self.chunks, self._ranks.size == 1)
        if inputs is not None:
            self.cut.prepare(inputs)
        runner = self._ensure_runner(x)
        if self.loss_fn is None:
            check_labels_on_last(targets, getattr(runner, "stage", None),
                                 self._schedule.placement[-1])
        # With data-parallel replicas, over the union of their batches.
        weights = None if targets is None else runner.data_parallel.loss_weights(
            self._loss_rule, targets, self._devices[-1])
        scale = 1.0
        if scaler is not None and scaler.is_enabled():
            scaler.scale(torch.zeros((), device=self._devices[-1]))  # its scale, on our device
            scale = float(scaler.get_scale())
        if weights is not None and scale != 1.0:
            weights = [w * scale for w in weights]
        loss, self._pending = runner.run_step(inputs, targets, weights)
        if scale != 1.0:
            self._ranks.share_overflow(self.parameters())
        return loss / scale if scale != 1.0 else loss

    def predict(self, x: Any, target: Any, optimizer: torch.optim.Optimizer | None = None
                ) -> Timeline:
        """The training step ``step(x, target)`` would run, simulated before running it.

        Each rank measures its own chunks as the runtime runs them (at the step's
        largest micro-batch, in this checkpoint mode, on its device), hops cost what
        the calibration at construction measured, and every rank gets the same
        Timeline. Nothing trains: parameters, ``.grad``, optimizer state, buffers
        (BatchNorm statistics) and the RNG state are as before. The makespan is
        comparable with ``pipe.timeline.makespan`` after a ``step``; ``peak_bytes``
        and ``memory`` hold each stage's predicted bytes (parameters, gradients,
        the optimizer's state, receive buffers and the activations the schedule
        holds). After steps the prediction is refined from the measured timelines of
        the last few (up to ``pipeline.runtime.runner.RECENT_STEPS``): the hop latency from the delays their
        waiting stages saw, each stage's compute from its median busy time
        (``pipeline.predict.step.predict_step`` returns the costs beside the Timeline).

        Args:
            x: the batch, as for ``step`` (with a group: on the first chunk's rank).
            target: the targets, as for ``step`` (with a group: on the last chunk's rank).
            optimizer: counted for its state (e.g. Adam: two tensors per parameter).

        Returns:
            The predicted Timeline.

        Raises:
            ValueError: no loss_fn, or a batch ``step`` would reject.
            PeerError: a rank failed or did not answer within the timeout.
        """
        with self._one_call("pipe.predict()"):
            return self._predict(x, target, optimizer)

    def _predict(self, x: Any, target: Any, optimizer: torch.optim.Optimizer | None
                 ) -> Timeline:
        from pipeline.predict.step import predict_step

        if self.loss_fn is None:
            raise ValueError("predict() needs a loss_fn: build the Pipe with loss_fn=...")
        inputs, targets = split_batch(x, target, self.chunks, self._ranks.size == 1, "predict")
        runner = self._ensure_runner(x)
        return predict_step(runner, inputs, targets, optimizer=optimizer,
                            ranks=self._ranks).timeline

    def __call__(self, x: Any) -> Any:
        """Forwards only; returns the merged output on the last device (on the last rank).

        In one process, with grad enabled, the output stays differentiable, so
        ``loss_fn(pipe(x), y).backward()`` also trains.
        """
        with self._one_call("pipe(x)"):
            return self._forward(x)

    def _forward(self, x: Any) -> Any:
        if x is None and self._ranks.size == 1:
            raise ValueError("pipe(x) needs an input batch in one process, got None")
        self.cut.check_model()
        if x is not None:
            self.cut.check_batch(x)
        inputs = split(x, self.chunks) if x is not None else None
        if inputs is not None:
            self.cut.prepare(inputs)
        runner = self._ensure_runner(x)
        outputs = runner.run_forward(inputs)
        if outputs is None:
            return None
        if isinstance(x, list):
            return outputs
        return merge(outputs)

    forward = __call__

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Release what this Pipe holds: communicators, buffers, in-flight messages; and
        take the forwards a split backward switched on off the model's layers.

        With a group, every rank calls it (it waits for all ranks, up to ``timeout``);
        then ``torch.distributed.destroy_process_group()`` is safe. It sends rank 0 the
        steps no read of ``pipe.timeline`` gathered, so that ``pipe.timeline`` still
        returns the last step's on rank 0 afterwards. The Pipe is not usable afterwards.
        ``with Pipe(...) as pipe:`` calls it on leaving the block.
        """
        with self._one_call("pipe.close()"):
            self._close()

    def _close(self) -> None:
        if self._runner is not None:
            self._release.detach()
            self._runner.close()
            self._runner = None
        self._closed = True

    def __enter__(self) -> Pipe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
