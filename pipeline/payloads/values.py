"""Values ranks share outside the pipeline's messages (settings, a plan, measured costs), as
checked JSON and raw tensor bytes: never pickle.

Bytes from a peer are input, never code: pickle's loader calls whatever a message names.
A value may hold plain data, tensors, and the library's own classes listed in
``crosses()``; anything else is refused at its sender. The receiver builds only those,
finds a class by its name in that list, and imports nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
from collections.abc import Mapping
from enum import Enum
from functools import cache
from typing import Any, TypeVar

import torch

from pipeline.payloads.checked_json import (MAX_DEPTH, StructureError, bounded_depth, bounded_int,
                                            expect, load_document, short, type_name)

FORMAT = 1  # the shared values' format version, the first field of every message
MAX_JSON_BYTES = 1 << 28  # a message's JSON text, at most
MAX_MESSAGE_BYTES = 1 << 34  # a whole message (JSON and tensor bytes), at most
T = TypeVar("T")
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex128,
    torch.complex64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


_REGISTERED: dict[str, type] = {}


def crossing(cls: type[T]) -> type[T]:
    """Let a frozen dataclass of the runtime's upper rooms (a probe's measurements, say) cross
    in shared values; the decorator sits on the class, so a receiver that can expect one has
    imported it."""
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):  # type: ignore[attr-defined]
        raise TypeError(f"only a frozen dataclass may cross ranks; got {cls.__qualname__}")
    _REGISTERED[cls.__name__] = cls
    return cls


def crosses() -> Mapping[str, type]:
    """The library's own classes that may cross in a shared value, by the name they cross under:
    frozen dataclasses (rebuilt by their constructors, which check them), enums (by value) and
    ``Action`` (by the text it prints, which parses back); the lower packages' here, the
    runtime's own where they are defined (``crossing``).
    """
    return types.MappingProxyType({**_lower_packages(), **_REGISTERED})


@cache
def _lower_packages() -> Mapping[str, type]:
    # Imported when first needed: the runtime, which imports this module for its
    # collectives, never needs the planner's classes.
    from partitioners.plan.search import Candidate, Plan
    from schedules.action import Action, Op, Schedule
    from schedules.timeline import Event, MemoryTrace, Timeline

    return {cls.__name__: cls for cls in (
        Action, Op, Schedule, Event, MemoryTrace, Timeline, Candidate, Plan)}


# Tuples stored as arrays (``schedules.stage_order.StageOrder``, ``plan_steps.PlanSteps``,
# ``events.Events``).
ARRAY_TUPLES = frozenset({"StageOrder", "PlanSteps", "Events"})

# A shared value's bytes: JSON of plain data, then the tensors' bytes.
#
#   message := n (8 bytes, little-endian) + n bytes of JSON (UTF-8) + each tensor's bytes
#   JSON    := {"format": 1, "value": value, "tensors": [[dtype, [size, ...]], ...]}
#   value   := null | true | false | int | float (as repr() writes it, exactly; NaN, Infinity)
#            | string | {"tuple": [value, ...]} | {"list": [value, ...]}
#            | {"dict": [[key, value], ...]} | {"mapping": [[key, value], ...]} (read-only)
#            | {"tensor": i} (the i-th tensor after the JSON, in order, each once)
#            | {"type": name, "fields": {field: value, ...}}  a dataclass in crosses()
#            | {"type": name, "value": value}  an enum in crosses()
#            | {"type": "Action", "text": "I3@c1"}
#   key     := string | int | {"tuple": [key, ...]}

def encode(value: Any, path: str = "value") -> bytes:
    """``value`` as a message that ``decode`` reads back exactly.

    Raises:
        TypeError: a part of ``value`` that may not cross ranks, named by its type and path.
        ValueError: nested deeper than ``MAX_DEPTH``, an int past ``MAX_INT_BITS`` bits, or
            larger than ``MAX_JSON_BYTES`` / ``MAX_MESSAGE_BYTES``.
    """
    tensors: list[torch.Tensor] = []
    document = {"format": FORMAT, "value": _encode(value, path, 0, tensors),
                "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]}
    text = json.dumps(document, separators=(",", ":")).encode("utf-8")
    data = [t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors]
    size = 8 + len(text) + sum(len(part) for part in data)
    if len(text) > MAX_JSON_BYTES or size > MAX_MESSAGE_BYTES:
        raise ValueError(f"a value crossing ranks may hold at most {MAX_JSON_BYTES} bytes of "
                         f"JSON and {MAX_MESSAGE_BYTES} in all, {path} has {len(text)} and {size}")
    return b"".join([len(text).to_bytes(8, "little"), text, *data])


def _encode(value: Any, path: str, depth: int, tensors: list[torch.Tensor]) -> Any:
    kind = type(value)
    if value is None or kind in (bool, float, str):
        return value
    if kind is int:
        return bounded_int(value, path)
    bounded_depth(depth, path)
    if kind is tuple or kind is list or kind.__name__ in ARRAY_TUPLES:
        # a timetable's arrays cross as the tuple of Actions they read as
        return {"list" if kind is list else "tuple": [
            _encode(item, f"{path}[{i}]", depth + 1, tensors) for i, item in enumerate(value)]}
    if kind is dict or kind is types.MappingProxyType:
        return {"dict" if kind is dict else "mapping": [
            [_key(key, path), _encode(item, f"{path}[{key!r}]", depth + 1, tensors)]
            for key, item in value.items()]}
    if isinstance(value, torch.Tensor):
        if value.dtype not in DTYPES.values() or value.layout is not torch.strided:
            raise TypeError(f"{path} is a {value.layout} tensor of {value.dtype}, which cannot "
                            f"cross to another rank: dense tensors of {', '.join(DTYPES)} can")
        tensors.append(value.detach().cpu().resolve_conj().resolve_neg().contiguous())
        return {"tensor": len(tensors) - 1}
    cls = crosses().get(kind.__name__)
    if cls is not kind:
        raise TypeError(f"{path} is a {type_name(kind)}, which cannot cross to another rank: a "
                        f"shared value holds None, bool, int, float, str, tensors, tuples, lists "
                        f"and dicts of them, and {', '.join(crosses())}")
    if kind.__name__ == "Action":
        return {"type": "Action", "text": str(value)}
    if isinstance(value, Enum):
        return {"type": kind.__name__, "value": _encode(value.value, f"{path}.value", depth + 1,
                                                        tensors)}
    return {"type": kind.__name__, "fields": {
        name: _encode(getattr(value, name), f"{path}.{name}", depth + 1, tensors)
        for name in _fields(kind)}}


def _key(key: Any, path: str) -> Any:
    if type(key) is str or type(key) is int:
        return key
    if type(key) is tuple:
        return {"tuple": [_key(item, path) for item in key]}
    raise TypeError(f"dict keys crossing ranks must be str, int or tuples of them, {path} has a "
                    f"key {short(key)} of type {type_name(type(key))}")


def _fields(cls: type) -> tuple[str, ...]:
    """The fields a dataclass's constructor takes (the others it computes)."""
    return tuple(field.name for field in dataclasses.fields(cls) if field.init)


def _required(cls: type) -> set[str]:
    """The constructor's fields without a default: a value may leave out the others (a
    ``Schedule`` without ``pairs`` is one without pairs)."""
    return {field.name for field in dataclasses.fields(cls) if field.init
            and field.default is dataclasses.MISSING
            and field.default_factory is dataclasses.MISSING}


def decode(data: bytes) -> Any:
    """The value that ``encode`` wrote as ``data``.

    Raises:
        StructureError: anything ``encode`` does not write (a ``ValueError``): not this
            framing, not UTF-8 JSON, a field of the wrong type or out of bounds, tensor bytes
            that do not add up, a type not in ``crosses()``, or fields its class refuses.
    """
    expect(8 <= len(data) <= MAX_MESSAGE_BYTES, f"a message of 8 to {MAX_MESSAGE_BYTES} bytes",
           len(data))
    length = int.from_bytes(data[:8], "little")
    expect(length <= min(MAX_JSON_BYTES, len(data) - 8), f"JSON of at most {MAX_JSON_BYTES} "
           f"bytes within the {len(data) - 8} that follow the length", length)
    document = load_document(bytes(data[8: 8 + length]), "a shared value",
                             ("format", "value", "tensors"), FORMAT,
                             parse_float=_parse_float, parse_constant=float)
    reader = _Reader(_read_tensors(document["tensors"], memoryview(data)[8 + length:]))
    value = reader.value(document["value"], 0)
    expect(reader.placed == len(reader.tensors), f"a value that places each of the "
           f"{len(reader.tensors)} tensors that came with it", reader.placed)
    return value


def _parse_float(text: str) -> float:
    expect(len(text) <= 32, "a float as repr() writes it", text)
    return float(text)


def _read_tensors(entries: Any, data: memoryview) -> list[torch.Tensor]:
    expect(type(entries) is list, "a list of tensors", entries)
    tensors, offset = [], 0
    for entry in entries:
        expect(type(entry) is list and len(entry) == 2 and type(entry[0]) is str
               and entry[0] in DTYPES and type(entry[1]) is list and len(entry[1]) <= MAX_DEPTH
               and all(type(n) is int and 0 <= n <= MAX_MESSAGE_BYTES for n in entry[1]),
               f"[a dtype among {', '.join(DTYPES)}, a shape]", entry)
        dtype, shape = DTYPES[entry[0]], entry[1]
        size = math.prod(shape) * dtype.itemsize
        expect(size <= len(data) - offset, f"{size} bytes of tensor data, at most what is "
               f"left", len(data) - offset)
        tensors.append(_tensor(data[offset: offset + size], dtype, shape))
        offset += size
    expect(offset == len(data), f"{offset} bytes of tensor data in all", len(data))
    return tensors


def _tensor(data: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    try:
        if not len(data):
            return torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    except RuntimeError as error:
        raise StructureError(f"expected a tensor of shape {short(shape)}: {error}") from error
    expect(dtype is not torch.bool or bool(raw.le(1).all()), "bools as bytes 0 and 1", "others")
    return raw.view(dtype).reshape(shape)


class _Reader:
    """The tensors that came with a message, placed in order as the value is read."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors, self.placed = tensors, 0

    def value(self, data: Any, depth: int) -> Any:
        if data is None or type(data) in (bool, int, float, str):
            return data
        expect(depth < MAX_DEPTH, f"at most {MAX_DEPTH} nested containers", "more")
        expect(type(data) is dict and (len(data) == 1 or "type" in data), "a value (null, "
               "true, false, a number, a string, or an object tagged tuple, list, dict, "
               "mapping or tensor, or with a type)", data)
        if "type" in data:
            return self.crossing(data, depth)
        (tag, body), = data.items()
        if tag in ("tuple", "list"):
            expect(type(body) is list, f"a {tag} of values", body)
            items = [self.value(item, depth + 1) for item in body]
            return tuple(items) if tag == "tuple" else items
        if tag in ("dict", "mapping"):
            expect(type(body) is list, f"a {tag} as [key, value] pairs", body)
            pairs = [self.pair(pair, depth) for pair in body]
            result = dict(pairs)
            expect(len(result) == len(pairs), "distinct dict keys", [key for key, _ in pairs])
            return result if tag == "dict" else types.MappingProxyType(result)
        expect(tag == "tensor" and type(body) is int and body == self.placed < len(self.tensors),
               f"a value tagged tuple, list, dict, mapping, or tensor {self.placed} of the "
               f"{len(self.tensors)} that came with it", data)
        self.placed += 1
        return self.tensors[body]

    def pair(self, pair: Any, depth: int) -> tuple[Any, Any]:
        expect(type(pair) is list and len(pair) == 2, "a [key, value] pair", pair)
        return _read_key(pair[0], depth + 1), self.value(pair[1], depth + 1)

    def crossing(self, data: dict[str, Any], depth: int) -> Any:
        """A class of ``crosses()``, rebuilt as it rebuilds itself."""
        name = data["type"]
        expect(type(name) is str and name in crosses(), f"a type among "
               f"{', '.join(crosses())} (nothing else is built on a peer's word)", name)
        cls = crosses()[name]
        if name == "Action":
            expect(set(data) == {"type", "text"} and type(data["text"]) is str
                   and len(data["text"]) <= 64, "an Action as its text", data)
            return _rebuild(name, cls.parse, data["text"])  # type: ignore[attr-defined]
        if issubclass(cls, Enum):
            expect(set(data) == {"type", "value"}, f"a {name} as its value", data)
            return _rebuild(name, cls, self.value(data["value"], depth + 1))
        fields = data.get("fields")
        expect(set(data) == {"type", "fields"} and type(fields) is dict
               and _required(cls) <= set(fields) <= set(_fields(cls)),
               f"a {name} with the fields {', '.join(_fields(cls))}", data)
        assert isinstance(fields, dict)  # checked just above
        values = {field: self.value(item, depth + 1) for field, item in fields.items()}
        return _rebuild(name, lambda: cls(**values))


def _read_key(data: Any, depth: int) -> Any:
    if type(data) is str or type(data) is int:
        return data
    expect(depth < MAX_DEPTH and type(data) is dict and set(data) == {"tuple"}
           and type(data["tuple"]) is list, "a str, int or tuple key", data)
    return tuple(_read_key(item, depth + 1) for item in data["tuple"])


def _rebuild(name: str, build: Any, *args: Any) -> Any:
    try:
        return build(*args)
    except Exception as error:  # the class's own checks refused what the peer sent
        raise StructureError(f"could not rebuild {name} from what was sent: "
                             f"{type(error).__name__}: {error}") from error
