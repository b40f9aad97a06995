"""Post-accumulate hooks on a parameter several chunks use: once per micro-batch, on the sum.

A head tied to the embedding of another stage is one Parameter into which two
chunks' backwards accumulate, so autograd would run its post-accumulate hooks once
per chunk and micro-batch, each time on a partial sum: a hook that steps an
optimizer in backward would step twice, on half a gradient each time. The plain
model, one backward per micro-batch, runs them once per micro-batch, on ``.grad``
holding the gradient of every micro-batch so far, both uses summed.

So while a step runs, such a parameter's hooks are set aside and one hook of ours
takes each chunk's contribution off ``.grad`` into its micro-batch's sum. Once every
chunk using the parameter has contributed to micro-batch m (and m - 1 has been handed
over), ``.grad`` becomes the sum over micro-batches 0..m and the user's hooks run on
it, in their order, as after the plain model's m-th backward; whatever they leave in
``.grad`` (``None`` after an optimizer's ``zero_grad``) is what later micro-batches add
to. The step ends with the user's hooks back in place and ``.grad`` holding what
the last hook left. Parameters without post-accumulate hooks are left alone: they
cost nothing. Chunks that share a parameter accumulate under one lock
(``accumulating``), which also tells our hook whose micro-batch it sees; an I
(which accumulates what it does not leave to W: embeddings, norms) takes the lock
only in a step with such hooks.

Parameters tied across ranks get their sum only after the step (one all-reduce), so
no hook of a rank could see it per micro-batch: ``refuse_hooks_across_ranks``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from pipeline.compute.shared import SharedParameter, chunk_layers, shared_parameters

Hooks = dict[Any, Callable[[torch.Tensor], None]]


def _hooks_of(parameter: nn.Parameter) -> Hooks | None:
    """The parameter's post-accumulate hooks (torch keeps them in this attribute)."""
    hooks: Hooks | None = getattr(parameter, "_post_accumulate_grad_hooks", None)
    return hooks


@dataclass
class _Gather:
    """One hooked parameter's step: the user's hooks, set aside, and the sums so far."""

    parameter: nn.Parameter
    users: int  # the chunks whose backward accumulates into it
    hooks: Hooks
    pending: dict[int, tuple[torch.Tensor | None, int]] = field(default_factory=dict)
    released: int = 0  # the micro-batches handed to the user's hooks
    total: torch.Tensor | None = None  # ``.grad`` as the user's hooks last left it


class SharedGrads:
    """Chunks of this process that accumulate into parameters they share.

    Args:
        users: each shared parameter with the number of this process's chunks using it.
    """

    def __init__(self, users: Sequence[tuple[nn.Parameter, int]]) -> None:
        self.lock = threading.Lock()
        self.microbatch: int | None = None
        self._users = [(parameter, count) for parameter, count in users if count > 1]
        self._gathers: list[_Gather] = []

    @contextmanager
    def accumulating(self, microbatch: int) -> Iterator[None]:
        """Hold the lock while a chunk's backward of ``microbatch`` accumulates gradients."""
        with self.lock:
            self.microbatch = microbatch
            try:
                yield
            finally:
                self.microbatch = None

    def accumulating_in_input(self, microbatch: int) -> AbstractContextManager[None]:
        """Around an I, which accumulates the weight gradients it does not defer to W
        (embeddings, norms): under the lock only in a step with hooks to run, so that
        I on one stage overlaps B and W on another otherwise."""
        return self.accumulating(microbatch) if self._gathers else nullcontext()

    def begin_step(self) -> None:
        """Set aside the hooks of each shared parameter that has any, ours in their place."""
        for parameter, users in self._users:
            hooks = _hooks_of(parameter)
            if not hooks:
                continue
            gather = _Gather(parameter, users, hooks)
            ours: Hooks = OrderedDict([(0, partial(self._take, gather))])
            parameter._post_accumulate_grad_hooks = ours
            self._gathers.append(gather)

    def end_step(self, succeeded: bool) -> None:
        """Put the user's hooks back; after a step that succeeded, hand over what is left
        (micro-batches some chunk never reached) and leave ``.grad`` as the hooks left it."""
        gathers, self._gathers = self._gathers, []
        for gather in gathers:
            gather.parameter._post_accumulate_grad_hooks = gather.hooks
        if not succeeded:
            return
        for gather in gathers:
            for microbatch in sorted(gather.pending):
                self._release(gather, microbatch)
            gather.parameter.grad = gather.total

    def _take(self, gather: _Gather, parameter: torch.Tensor) -> None:
        """Our hook: move a chunk's contribution into its micro-batch's sum."""
        microbatch = self.microbatch if self.microbatch is not None else gather.released
        grad, parameter.grad = parameter.grad, None
        summed, count = gather.pending.get(microbatch, (None, 0))
        if grad is not None:
            summed = grad if summed is None else summed + grad
        gather.pending[microbatch] = (summed, count + 1)
        while gather.pending.get(gather.released, (None, 0))[1] >= gather.users:
            self._release(gather, gather.released)

    def _release(self, gather: _Gather, microbatch: int) -> None:
        """Run the user's hooks on ``.grad`` = the sum up to and with ``microbatch``."""
        summed, _ = gather.pending.pop(microbatch)
        gather.released = microbatch + 1
        parameter = gather.parameter
        if summed is not None:
            parameter.grad = summed if gather.total is None else gather.total + summed
        else:
            parameter.grad = gather.total
        for hook in list(gather.hooks.values()):
            hook(parameter)
        gather.total, parameter.grad = parameter.grad, None


def chunk_users(model: nn.Sequential, balance: Sequence[int], chunks: Sequence[int]
                ) -> list[tuple[nn.Parameter, int]]:
    """Each parameter shared by layers of ``chunks`` with the number of those chunks using it."""
    layers_of = chunk_layers(balance)
    found = []
    for shared in shared_parameters(model).values():
        count = sum(1 for chunk in chunks if set(shared.layers) & set(layers_of[chunk]))
        found.append((_parameter(model, shared), count))
    return found


def _parameter(model: nn.Sequential, shared: SharedParameter) -> nn.Parameter:
    index, _, name = shared.name.partition(".")
    parameter = model[int(index)].get_parameter(name)
    assert isinstance(parameter, nn.Parameter)  # get_parameter returns only parameters
    return parameter


def refuse_hooks_across_ranks(parameters: Sequence[nn.Parameter | None],
                              names: dict[int, str]) -> None:
    """Raise ValueError if a parameter tied across ranks has post-accumulate hooks.

    Args:
        parameters: this rank's copies of the parameters whose gradients are summed across
            ranks after the step (None where the rank holds none).
        names: ``id`` of each such parameter -> its key, for the message.
    """
    hooked = [names.get(id(p), "?") for p in parameters if p is not None and _hooks_of(p)]
    if hooked:
        raise ValueError(
            f"post-accumulate-grad hooks on {hooked}: these parameters are tied across stages "
            f"on different ranks, whose gradients are summed only after the step, so no hook "
            f"can see the summed gradient of a micro-batch (the plain model's hooks do); cut "
            f"the model so that the tied layers share a stage or run it in one process "
            f"(devices=[...]), or apply the update after pipe.step() instead of in a hook")
