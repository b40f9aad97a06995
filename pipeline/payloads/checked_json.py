"""JSON from a peer, checked: the error for bytes no sender writes, and the bounds and readers
that the payloads' structures and the collectives' shared values both use."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, cast

MAX_DEPTH = 64  # containers inside containers, at most
MAX_INT_BITS = 256  # an int's magnitude, at most


class StructureError(ValueError):
    """Bytes from a peer that no sender of their format writes (a payload's structure, a value
    shared by a collective): corrupt, truncated or hostile."""


def type_name(cls: type) -> str:
    module = getattr(cls, "__module__", "")
    qualname = getattr(cls, "__qualname__", repr(cls))
    return qualname if module == "builtins" else f"{module}.{qualname}"


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_int(text: str) -> int:
    # Bounded before int() parses it (quadratic in the digits), then exactly.
    value = int(text) if len(text) <= MAX_INT_BITS // 3 + 2 else None
    if value is None or value.bit_length() > MAX_INT_BITS:
        raise StructureError(f"expected an int of at most {MAX_INT_BITS} bits, got "
                             f"{short(text)}")
    return value


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise StructureError(f"expected distinct keys in a JSON object, got "
                             f"{short([key for key, _ in pairs])}")
    return result


def load_document(data: bytes, what: str, keys: tuple[str, ...], version: int,
                  parse_float: Callable[[str], Any],
                  parse_constant: Callable[[str], Any]) -> dict[str, Any]:
    """The JSON object a peer sent: UTF-8, ints bounded, keys distinct, exactly ``keys``
    (the first one ``"format"``, equal to ``version``); a StructureError otherwise."""
    try:
        document = json.loads(data.decode("utf-8"), parse_int=parse_int,
                              parse_float=parse_float, parse_constant=parse_constant,
                              object_pairs_hook=unique_keys)
    except StructureError:
        raise
    except (ValueError, RecursionError) as error:
        raise StructureError(f"expected {what} in JSON: {error}") from error
    named = f"{', '.join(keys[:-1])} and {keys[-1]}"
    expect(type(document) is dict and set(document) == set(keys),
           f"an object with keys {named}", document)
    expect(document["format"] == version and type(document["format"]) is int,
           f"format {version}", document["format"])
    return cast(dict[str, Any], document)  # json.loads gives Any; checked a dict above


def bounded_int(value: int, path: str) -> int:
    """``value``, or ValueError past ``MAX_INT_BITS`` bits (at the sender, naming ``path``)."""
    if value.bit_length() > MAX_INT_BITS:
        raise ValueError(f"an int crossing ranks has at most {MAX_INT_BITS} bits, "
                         f"{path} has {value.bit_length()}: send it as a tensor")
    return value


def bounded_depth(depth: int, path: str) -> None:
    """ValueError once a value nests ``MAX_DEPTH`` containers (at the sender, naming ``path``)."""
    if depth >= MAX_DEPTH:
        raise ValueError(f"a value crossing ranks may nest at most {MAX_DEPTH} containers, "
                         f"got more at {path}")


def expect(condition: bool, expected: str, given: Any) -> None:
    if not condition:
        raise StructureError(f"expected {expected}, got {short(given)}")
