"""The errors of tracing and cutting a model into units."""

from __future__ import annotations

import re

from torch import nn


class TraceError(ValueError):
    """A model that cannot be traced or cut as asked; the message says what to do."""

    @classmethod
    def from_export(cls, error: BaseException, model: nn.Module) -> TraceError:
        text = str(error).strip()
        first = text.splitlines()[0] if text else type(error).__name__
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
