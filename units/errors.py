"""The errors of tracing and cutting a model into units."""

from __future__ import annotations

import os
import re
import traceback

import torch
from torch import nn


class TraceError(ValueError):
    """A model that cannot be traced or cut as asked; the message says what to do."""

    @classmethod
    def from_export(cls, error: BaseException, model: nn.Module) -> TraceError:
        text = str(error).strip()
        first = text.splitlines()[0] if text else type(error).__name__
        where = _module_raising(error, model)  # "": the model's own forward
        if where is None:
            where = _module_named_in(text, model)
        data_dependent = "data-dependent" in text or "GuardOnDataDependent" in type(error).__name__
        advice = (
            "its Python control flow depends on tensor values, which a graph cannot "
            "follow" if data_dependent else "torch.export refused it"
        )
        place = f" in {where!r}" if where else ""
        return cls(
            f"cannot trace {type(model).__name__}{place}: {advice} ({type(error).__name__}: "
            f"{first[:300]}). Make that code depend on shapes only, or give the Pipe an "
            f"nn.Sequential of your blocks; units=[...] sets where units begin"
        )


def _module_raising(error: BaseException, model: nn.Module) -> str | None:
    """The module of ``model`` whose code was running where export gave up: the innermost
    frame of the traceback (of ``error`` or of the errors it was raised from, the first
    raised preferred) whose ``self`` is one of the model's modules, a frame of the user's
    own code (not torch's: a ``Linear`` called by the code that branches) preferred."""
    names = {id(module): name for name, module in model.named_modules()}
    found = [_innermost(raised, names) for raised in reversed(_chain(error))]
    for user_code in (True, False):
        for ours, anywhere in found:
            name = ours if user_code else anywhere
            if name is not None:
                return name
    return None


def _innermost(error: BaseException, names: dict[int, str]) -> tuple[str | None, str | None]:
    """The innermost frame of ``error``'s traceback whose ``self`` is a module ``names``
    names: (in the user's code, in any code)."""
    ours = anywhere = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        name = names.get(id(frame.f_locals.get("self")))
        if name is not None:
            anywhere = name
            if not frame.f_code.co_filename.startswith(_TORCH):
                ours = name
    return ours, anywhere


_TORCH = os.path.dirname(torch.__file__) + os.sep


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and the errors it was raised from or while handling, the first raised last."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _module_named_in(text: str, model: nn.Module) -> str | None:
    """The deepest module of ``model`` whose class or source file the export error names."""
    found = None
    for name, module in model.named_modules():
        cls = type(module)
        file = getattr(__import__(cls.__module__, fromlist=["_"]), "__file__", None) or ""
        if re.search(rf"\b{re.escape(cls.__name__)}\b", text) or (
                file and file in text and not file.endswith(("torch/nn/modules/module.py",))):
            if found is None or len(name) > len(found):
                found = name
    return found or None
