"""The nn.Module-like methods of a Pipe: parameters, train/eval, gradients and state dicts.

Each works on the model before the Pipe has built its runner and on the runner's share
of the model after (with a group: this rank's layers only).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from units import Cut

from pipeline.compute.dtensors import is_dtensor
from pipeline.runtime.runner import Runner


Same = TypeVar("Same", bound="ModelLike")


class ModelLike:
    """Mixed into ``Pipe``: what a training loop calls on a model."""

    model: nn.Sequential
    source_model: nn.Module
    cut: Cut
    _runner: Runner | None

    @property
    def local_layers(self) -> list[int]:
        """The indices of the model's layers this process runs (all of them in one process).

        Raises:
            ValueError: the model is not cut yet (``balance="time"`` waits for a batch).
        """
        if self._runner is None:
            raise ValueError("this Pipe has not cut its model yet (balance='time' waits for "
                             "its first batch): run a step first")
        return list(self._runner.local_layers)

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters this process holds (all of them in one process), each once; after
        ``close``, those it held (a rank's share of the model stays where it was)."""
        if self._runner is None:
            return (p for p in self.model.parameters() if not p.is_meta)
        return self._runner.parameters()

    def train(self: Same, mode: bool = True) -> Same:
        self.model.train(mode)
        self.source_model.train(mode)  # a traced model's units run the root's mode
        return self

    def eval(self: Same) -> Same:
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for parameter in self.parameters():
            if set_to_none:
                parameter.grad = None
            elif parameter.grad is not None:
                parameter.grad.zero_()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state under its own keys (with a group: this rank's layers only;
        sharded entries whole, so every replica must call it)."""
        return {key: tensor.full_tensor() if is_dtensor(tensor) else tensor
                for key, tensor in self.cut.named_state(self._local())}

    def _local(self) -> list[int] | None:
        return None if self._runner is None else list(self._runner.local_layers)

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load a state dict saved from the model or the Pipe (keys of other ranks are skipped).

        Checked alike on every rank, so that every rank raises or none does: with
        ``strict``, missing and unexpected keys (of the whole model where the state has
        keys of other ranks' layers); always, a state that gives one shared parameter (a
        head tied to the embedding) two values.

        Raises:
            ValueError: keys missing or unexpected (strict), or a tie the state would break.
        """
        self.cut.load_state_dict(state, self._local(), strict=strict)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over every stage's gradients; returns that total norm.

        Same result as ``torch.nn.utils.clip_grad_norm_`` on the unpipelined model.
        """
        if self._runner is None:
            return torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), max_norm, norm_type)
        return self._runner.clip_grad_norm_(max_norm, norm_type)
