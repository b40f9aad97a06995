"""What the CLI is given, made real: import a model factory, parse shapes, build a sample."""

from __future__ import annotations

import importlib
import math
import os
import sys
from typing import Any

from partitioners.measure.sizes import format_bytes

_FLOAT_HINT = "expected comma-separated positive integers such as 32,1024 (';' between inputs)"


class UsageError(Exception):
    """An error in what the user asked for: reported on one line, exit status 2."""


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``"32,1024"`` -> ``[(32, 1024)]``; ``"32,16;32,8"`` -> two inputs.

    Raises:
        UsageError: anything but positive integers separated by commas.
    """
    shapes = []
    for part in text.split(";"):
        try:
            shape = tuple(int(dim) for dim in part.split(","))
        except ValueError:
            raise UsageError(f"malformed --input-shape {text!r}: {_FLOAT_HINT}") from None
        if any(dim < 1 for dim in shape):
            raise UsageError(f"malformed --input-shape {text!r}: {_FLOAT_HINT}")
        shapes.append(shape)
    return shapes


def load_factory(spec: str) -> Any:
    """Import ``"pkg.module:factory"`` (the current directory is importable) and return it.

    Raises:
        UsageError: a malformed spec, a module that does not import, a missing
            attribute, or one that is not callable.
    """
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise UsageError(f"expected MODULE:FACTORY such as mypkg.models:build, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError(f"cannot import module {module_name!r}: {error}") from None
    except SystemExit as exit_:  # a script's sys.exit() at import time: not a model
        raise UsageError(
            f"importing module {module_name!r} called sys.exit({exit_.code!r}); expected a "
            f"module that defines {attribute!r} without exiting"
        ) from None
    except Exception as error:  # noqa: BLE001 - the user's module raised while importing
        raise UsageError(
            f"importing module {module_name!r} raised {type(error).__name__}: {error}"
        ) from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise UsageError(f"module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise UsageError(f"{spec} is a {type(target).__name__}, expected a callable factory")
    return target


def build_model(spec: str) -> Any:
    """Call the factory named by ``spec`` and check that it returns an nn.Module (an
    nn.Sequential: not empty; any other module is cut by ``cut_for_command``).

    Raises:
        UsageError: the factory cannot be loaded, raises, calls ``sys.exit``, or
            returns something else.
    """
    from torch import nn

    factory = load_factory(spec)
    try:
        model = factory()
    except SystemExit as exit_:  # exit status 0 would otherwise pass for success
        raise UsageError(
            f"{spec}() called sys.exit({exit_.code!r}); expected it to return an nn.Module"
        ) from None
    except Exception as error:  # noqa: BLE001 - the user's factory raised
        raise UsageError(f"{spec}() raised {type(error).__name__}: {error}") from None
    if not isinstance(model, nn.Module):
        raise UsageError(f"{spec}() returned a {type(model).__name__}, expected an nn.Module "
                         f"(an nn.Sequential, or any module that torch.export can trace)")
    if isinstance(model, nn.Sequential) and len(model) == 0:
        raise UsageError(f"{spec}() returned an empty nn.Sequential, expected at least one layer")
    return model


def cut_for_command(model: Any, sample: Any) -> Any:
    """``model`` as the Pipe runs it (``partitioners.measure.model_cut.cut_of``): a
    ``units.Cut`` whose ``units`` are profiled, priced and balanced.

    Raises:
        UsageError: the model cannot be traced with this sample; the message says why.
    """
    from partitioners.measure.model_cut import cut_of
    from units import TraceError

    try:
        return cut_of(model, sample)
    except TraceError as error:
        raise UsageError(str(error)) from None


def make_sample(shapes: list[tuple[int, ...]], dtypes: str) -> Any:
    """Random floating inputs (zeros for integer dtypes, valid as indices) of the given shapes.

    Raises:
        UsageError: an unknown dtype, a count of dtypes that matches neither one
            nor the number of inputs, or inputs too large to allocate (more bytes
            than this machine's memory, or an allocation that fails).
    """
    import torch

    names = [name.strip() for name in dtypes.split(";")]
    if len(names) == 1:
        names *= len(shapes)
    if len(names) != len(shapes):
        raise UsageError(
            f"--dtype: expected one dtype or {len(shapes)} (one per input), got {len(names)}"
        )
    kinds = []
    for name in names:
        dtype = getattr(torch, name.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise UsageError(f"--dtype: unknown dtype {name!r}, expected e.g. float32 or int64")
        kinds.append(dtype)
    _check_fits(shapes, kinds)
    tensors = []
    for shape, dtype in zip(shapes, kinds):
        try:
            if dtype.is_floating_point or dtype.is_complex:
                tensors.append(torch.randn(shape, dtype=dtype))
            else:
                tensors.append(torch.zeros(shape, dtype=dtype))
        except (RuntimeError, MemoryError):  # torch's message is a C++ trace: say it plainly
            raise UsageError(_too_large(shapes, kinds, "the allocation failed")) from None
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def _check_fits(shapes: list[tuple[int, ...]], dtypes: list[Any]) -> None:
    """Refuse inputs larger than physical memory before the allocator (or the OOM killer) does."""
    memory = _physical_memory()
    if memory is not None and _sample_bytes(shapes, dtypes) > memory:
        raise UsageError(_too_large(shapes, dtypes, f"this machine has {format_bytes(memory)}"))


def _sample_bytes(shapes: list[tuple[int, ...]], dtypes: list[Any]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes))


def _too_large(shapes: list[tuple[int, ...]], dtypes: list[Any], why: str) -> str:
    text = ";".join(",".join(str(dim) for dim in shape) for shape in shapes)
    size = format_bytes(_sample_bytes(shapes, dtypes), exact=True)
    return f"cannot allocate the --input-shape {text} sample: {size}; {why}; reduce --input-shape"


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not on this platform
        return None
