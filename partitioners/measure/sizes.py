"""Read and print byte sizes: ``"8GiB"``, ``"512MB"``, ``"1e9"`` and back."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4, "pb": 1000**5,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "pib": 1024**5,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> float:
    """``"8GiB"`` -> 8 * 2**30; ``"512MB"`` -> 512e6; ``"1e9"`` -> 1e9 (units: B, kB..PB, KiB..PiB).

    Raises:
        ValueError: text that is not a non-negative number with a known unit.
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"expected a size such as 8GiB, 512MB or 1e9 (units B, kB, MB, GB, TB, "
            f"KiB, MiB, GiB, TiB), got {text!r}"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise ValueError(f"expected a finite size, got {text!r}")
    return value


def format_bytes(value: float, exact: bool = False) -> str:
    """``1610612736`` -> ``"1.50 GiB"``; with ``exact``, ``"1.50 GiB (1610612736 bytes)"``."""
    size = float(value)
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(size) < 1024 or unit == "PiB":
            break
        size /= 1024
    if unit == "B":
        return f"{size:.0f} B"
    readable = f"{size:.2f} {unit}" if size < 100 else f"{size:.1f} {unit}"
    return f"{readable} ({math.ceil(value)} bytes)" if exact else readable
