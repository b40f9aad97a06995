"""Cost values checked: a number or a sequence of numbers, each finite and >= 0, or an error
naming the value (``Costs`` and ``simulate``'s keywords take them from users)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import cast


def check_number(name: str, value: object, where: str = "") -> float:
    """``value`` as a float, or ValueError unless it is finite and >= 0 (NaN included)."""
    if type(value) is float or type(value) is int:  # the common case, without the ABC check
        number = float(value)
        if 0.0 <= number < math.inf:
            return number
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number{where}, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number}{where}")
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {number}{where}")
    return number


def checked_value(name: str, value: object) -> float | tuple[float, ...]:
    """One cost as a float or a tuple of floats, each finite and >= 0.

    Raises:
        ValueError: naming ``name`` (and the item), for a negative, NaN or infinite value.
        TypeError: a value that is neither a number nor a sequence of numbers.
    """
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return check_number(f"{name} cost", value)
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name}: expected a number or a sequence of numbers, got {value!r}")
    try:
        # Anything tuple() accepts: the TypeError it raises otherwise is the check.
        values = tuple(cast(Iterable[object], value))
    except TypeError:
        raise TypeError(f"{name}: expected a number or a sequence of numbers, "
                        f"got {value!r}") from None
    checked = []
    for index, item in enumerate(values):
        if type(item) is float and 0.0 <= item < math.inf:  # valid: no message to format
            checked.append(item)
        else:
            checked.append(check_number(f"{name} cost", item, f" (item {index})"))
    return tuple(checked)
