"""Which chunk inputs the layers run on as they are, and which on copies, so no write reaches them.

Why: a layer may write its input in place (an in-place ReLU first in a stage, ``if
h.isnan().any(): h.nan_to_num_()``), and a chunk's inputs are the caller's ``x`` (or
views of it), the tensors a sender still holds, and what a recomputation starts from.
Whether a layer writes may depend on the data (only the micro-batches with a NaN), so
it is settled for every forward, not learned from the first micro-batch.

The rule: a tensor input runs as it is only where a write harms nobody or torch itself
refuses it before making it. The first chunk's forwards that build the graph run on
copies of the caller's ``x`` that the chunk keeps in place of the views it held (the
plain model would write ``x``; a pipeline never does), used by nothing after them.
Inputs that require grad, in a forward that builds the graph (a later chunk's
differentiable ones, or ``x`` when it requires grad), are leaves of the chunk's own:
torch refuses a write to them. Every other input runs on a copy:
non-differentiable ones (masks, indices), and all of them in a forward without grad
(the first forward of a recomputed micro-batch, inference), where the copy lives only
as long as the forward. When torch
refuses a write to an input that runs as it is, nothing has been written: the chunk
runs that forward again on copies (``ChunkRunner`` puts the generators back first), and
copies everything from then on. After each forward, the version counters of the copies
tell whether the layers wrote them; a chunk that did copies everything from then on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipeline.payloads.tree import Flat

# torch's words when an in-place op meets a leaf (or a view of one) that requires grad.
_REFUSALS = (
    "a leaf Variable that requires grad is being used in an in-place operation",
    "a view of a leaf Variable that requires grad is being used in an in-place operation",
)


@dataclass(frozen=True)
class Prepared:
    """A forward's inputs: the value the layers get, its copies and the inputs given as they are."""

    value: Any
    copies: tuple[torch.Tensor, ...]
    as_is: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]  # of ``as_is``, before the forward


class InputWrites:
    """Decides, per forward, which inputs of a chunk its layers get as copies."""

    def __init__(self) -> None:
        self.writes = False  # the layers wrote an input once: copy every input from now on

    def prepare(self, inputs: Flat, owned: bool = False) -> Prepared:
        """The leaves for one forward: copies, except those torch guards itself (and, if
        ``owned``, those that need no grad: the chunk's own copies, last used here)."""
        guarded = torch.is_grad_enabled() and not self.writes
        leaves: list[object] = []
        copies: list[torch.Tensor] = []
        as_is: list[torch.Tensor] = []
        for leaf in inputs.leaves:
            if isinstance(leaf, torch.Tensor):
                if guarded and leaf.requires_grad and leaf.is_leaf:
                    as_is.append(leaf)
                elif leaf.requires_grad or not owned:
                    leaf = leaf.clone()
                    copies.append(leaf)
            leaves.append(leaf)
        return Prepared(inputs.rebuild(leaves), tuple(copies), tuple(as_is),
                        tuple(t._version for t in as_is))

    def refused(self, error: BaseException | None, prepared: Prepared) -> bool:
        """Whether ``error`` is torch refusing a write to an input given as it is; if so,
        nothing was written, and every input is a copy from now on."""
        if not prepared.as_is or not isinstance(error, RuntimeError):
            return False
        if not any(refusal in str(error) for refusal in _REFUSALS):
            return False  # a parameter, say: the plain model fails the same way
        self.writes = True
        return True

    def check(self, prepared: Prepared) -> None:
        """After a forward: note whether its layers wrote an input (a copy)."""
        if self.writes:
            return
        # Inference tensors (a copy made under inference_mode) keep no version counter,
        # and what they are copies of was left untouched anyway.
        wrote = any(t._version for t in prepared.copies if not t.is_inference())
        # A write torch let through (under an inner no_grad) reached an input as the
        # plain model's would reach it; the next forwards run on copies.
        wrote = wrote or any(t._version != v for t, v in zip(prepared.as_is, prepared.versions))
        self.writes = wrote


def owned_copy(inputs: Flat) -> Flat:
    """``inputs`` with copies of the tensors that need no grad (those that do are leaves of
    their own already, which torch guards)."""
    return Flat(tuple(
        leaf.clone() if isinstance(leaf, torch.Tensor) and not leaf.requires_grad else leaf
        for leaf in inputs.leaves
    ), inputs.spec)
