"""Byte sizes: parse what the CLI is given, print what it reports."""

from __future__ import annotations

import pytest

from partitioners.measure.sizes import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8GiB", 8 * 2**30), ("512MB", 512e6), ("1e9", 1e9), ("1.5 GiB", 1.5 * 2**30),
        ("100", 100), ("64kb", 64e3), ("2KiB", 2048), ("3tb", 3e12), ("0", 0), ("7B", 7),
    ],
)
def test_parse_bytes(text: str, value: float) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "8XB", "-1GB", "1,5GB", "8 Gi B", "1e999"])
def test_parse_bytes_rejects_malformed_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="expected a"):
        parse_bytes(text)


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**30, exact=True) == "3.00 GiB (3221225472 bytes)"
    assert format_bytes(200 * 2**20) == "200.0 MiB"
