"""A payload's structure and non-tensor leaves as checked JSON, to cross ranks beside its tensors.

Between ranks the structure is bytes from a peer, and bytes from a peer are
input, never code. So it travels as JSON of plain data that this module writes
and reads itself: not pickle (whose loader calls whatever a message names, so
a leaf's ``__reduce__`` would run on the receiver), and not
``torch.utils._pytree.treespec_loads`` either (its JSON hooks import any module
a message names, and it cannot name a namedtuple or an unregistered
dataclass). The receiver builds only tuples, lists, dicts, OrderedDicts,
namedtuples, and classes registered as pytree nodes on its own side; it finds a
class by module and qualified name among the modules it has already imported,
and imports nothing. Other non-tensor leaves are refused at the sender, naming
where they sit, before anything is sent.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from collections import OrderedDict, defaultdict, namedtuple
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pipeline.payloads.checked_json import (MAX_DEPTH, StructureError, bounded_depth, bounded_int,
                                            expect, load_document, short, type_name)

FORMAT = 1  # the structure's format version, the first field of every structure
MAX_STRUCTURE_BYTES = 1 << 20  # a structure's JSON text, at most (large data belongs in tensors)
MAX_NAME_CHARS = 512  # a class's "module:qualname", at most
ALLOWED = "None, bool, int, float, complex and str (also in tuples, lists and dicts)"


# Sending: a TreeSpec and its leaves -> JSON of plain data.
#
#   structure := {"format": 1, "tree": node, "leaves": [leaf, ...]}
#   node  := null (the next leaf) | {"node": "tuple" | "list", "children": [node, ...]}
#          | {"node": "dict" | "OrderedDict", "keys": [key, ...], "children": [node, ...]}
#          | {"node": "namedtuple", "class": "module:qualname", "children": [node, ...]}
#          | {"node": "registered", "class": "module:qualname", "context": value,
#             "children": [node, ...]}
#   leaf  := {"tensor": i} (the i-th tensor sent beside, in order) | value
#   value := null | true | false | int | string | {"float": float.hex()}
#          | {"complex": [hex, hex]} | {"tuple": [value, ...]} | {"list": [value, ...]}
#          | {"dict": [[key, value], ...]}
#   key   := string | int

def encode_structure(spec: pytree.TreeSpec, leaves_in_order: Sequence[Any]) -> bytes:
    """The JSON text, in UTF-8, of a flattened payload's structure and non-tensor leaves.

    Raises:
        TypeError: a leaf or container that may not cross ranks, named by its path.
        ValueError: nested deeper than ``MAX_DEPTH`` or larger than ``MAX_STRUCTURE_BYTES``.
    """
    leaves: list[Any] = []
    tree = _node(spec, _Leaves(leaves_in_order, leaves), "output", 0)
    text = json.dumps({"format": FORMAT, "tree": tree, "leaves": leaves},
                      separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(text) > MAX_STRUCTURE_BYTES:
        raise ValueError(f"a stage's output may hold at most {MAX_STRUCTURE_BYTES} bytes of "
                         f"structure and non-tensor leaves, got {len(text)}: send data as tensors")
    return text


class _Leaves:
    """The leaves of a payload in order, encoded as the sender's walk reaches them."""

    def __init__(self, leaves: Sequence[Any], out: list[Any]) -> None:
        self.leaves, self.out, self.tensors = iter(leaves), out, 0

    def take(self, path: str) -> None:
        leaf = next(self.leaves)
        if isinstance(leaf, torch.Tensor):
            self.out.append({"tensor": self.tensors})
            self.tensors += 1
        else:
            self.out.append(_value(leaf, path, 0, None))


def _node(spec: Any, leaves: _Leaves, path: str, depth: int) -> Any:
    """``spec`` as a JSON node, its leaves encoded into ``leaves``; ``path`` names it in errors."""
    if spec.is_leaf():
        leaves.take(path)
        return None
    if depth >= MAX_DEPTH:
        raise ValueError(f"a stage's output may nest at most {MAX_DEPTH} containers, "
                         f"got more at {path}")
    kind, context, children = spec.type, spec.context, spec.children()
    if kind in (tuple, list):
        return {"node": kind.__name__, "children": _walk(
            children, [f"[{i}]" for i in range(len(children))], leaves, path, depth)}
    if kind in (dict, OrderedDict):
        for key in context:
            _check_key(key, path)
        return {"node": kind.__name__, "keys": list(context), "children": _walk(
            children, [f"[{key!r}]" for key in context], leaves, path, depth)}
    if kind is namedtuple:
        return {"node": "namedtuple", "class": _sendable_class(context, path), "children": _walk(
            children, [f".{field}" for field in context._fields], leaves, path, depth)}
    if kind is defaultdict or kind in pytree.CONSTANT_NODES:
        raise TypeError(f"{path} is a {type_name(kind)}, whose structure holds code or objects, "
                        f"so it cannot cross to another rank: convert it to a dict or tensors")
    labels = ([f".{name}" for name in context[0]]
              if _is_dataclass_context(kind, context, len(children))
              else [f"[{i}]" for i in range(len(children))])
    return {"node": "registered", "class": _sendable_class(kind, path),
            "context": _value(context, f"the context of {path}", 0, kind),
            "children": _walk(children, labels, leaves, path, depth)}


def _walk(children: Sequence[Any], labels: Sequence[str], leaves: _Leaves, path: str,
          depth: int) -> list[Any]:
    return [_node(child, leaves, path + label, depth + 1) for child, label in zip(children, labels)]


def _value(value: Any, path: str, depth: int, node: type | None) -> Any:
    """``value`` as JSON; ``node``: the registered class whose context it is, None for a leaf."""
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return bounded_int(value, path)
    if kind is float:
        return {"float": value.hex()}
    if kind is complex:
        return {"complex": [value.real.hex(), value.imag.hex()]}
    bounded_depth(depth, path)
    if kind is tuple or kind is list:
        return {kind.__name__: [_value(item, f"{path}[{i}]", depth + 1, node)
                                for i, item in enumerate(value)]}
    if kind is dict:
        for key in value:
            _check_key(key, path)
        return {"dict": [[key, _value(item, f"{path}[{key!r}]", depth + 1, node)]
                         for key, item in value.items()]}
    raise TypeError(f"{path} is a {type_name(kind)}, which cannot cross to another rank: "
                    f"{_advice(value, node)}")


def _advice(value: Any, node: type | None) -> str:
    if node is not None:
        return (f"{type_name(node)} is registered as a pytree node, and its context must then "
                f"be plain data: {ALLOWED}")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (f"a dataclass crosses as a pytree node, its fields as leaves (tensors keep their "
                f"gradients): call torch.utils._pytree.register_dataclass("
                f"{type(value).__qualname__}) on every rank. Besides tensors, leaves may be "
                f"{ALLOWED}")
    return (f"besides tensors, leaves may be {ALLOWED}. Convert it to a tensor, or register "
            f"its class as a pytree node on every rank (torch.utils._pytree.register_dataclass "
            f"for a dataclass, register_pytree_node otherwise)")


def _check_key(key: Any, path: str) -> None:
    if type(key) is not str and type(key) is not int:
        raise TypeError(f"dict keys crossing ranks must be str or int, {path} has a key "
                        f"{short(key)} of type {type_name(type(key))}")


def _is_dataclass_context(kind: Any, context: Any, count: int) -> bool:
    """Whether ``context`` is register_dataclass's ``[field names, None fields]``."""
    return (dataclasses.is_dataclass(kind) and type(context) is list and len(context) == 2
            and type(context[0]) is list and len(context[0]) == count)


def _sendable_class(cls: type, path: str) -> str:
    name = f"{cls.__module__}:{cls.__qualname__}"
    if find_class(name) is not cls:
        raise TypeError(f"{path} is a {type_name(cls)}, whose class cannot be found by its name "
                        f"{name!r} (defined inside a function, or redefined?), so another rank "
                        f"could not rebuild it: define the class at module level")
    return name


def find_class(name: str) -> type | None:
    """The class called ``"module:qualname"`` in a module already imported, or None.

    Nothing is imported and no attribute hook runs: only module and class namespaces are read.
    """
    module_name, colon, qualname = name.partition(":")
    parts = qualname.split(".")
    if not colon or len(name) > MAX_NAME_CHARS or not all(
            part.isidentifier() for part in (*module_name.split("."), *parts)):
        return None
    found: Any = sys.modules.get(module_name)
    for index, part in enumerate(parts):
        if not isinstance(found, type if index else types.ModuleType):
            return None
        found = vars(found).get(part)
    return found if isinstance(found, type) else None


# Receiving: JSON from a peer -> the payload, every field checked.

def decode_structure(data: bytes, tensors: Sequence[torch.Tensor]) -> Any:
    """The payload that ``encode_structure`` wrote as ``data``, with ``tensors`` in place.

    Raises:
        StructureError: anything ``encode_structure`` does not write (not UTF-8 JSON, a field
            of the wrong type or out of its bounds, leaves or tensors that do not add up), or
            a class this process does not know as a namedtuple or a registered pytree node.
    """
    if len(data) > MAX_STRUCTURE_BYTES:
        raise StructureError(f"expected a structure of at most {MAX_STRUCTURE_BYTES} bytes, "
                             f"got {len(data)}")
    document = load_document(data, "a structure", ("format", "tree", "leaves"), FORMAT,
                             parse_float=_refuse_number, parse_constant=_refuse_number)
    expect(type(document["leaves"]) is list, "a list of leaves", document["leaves"])
    leaves, placed = [], 0
    for entry in document["leaves"]:
        if type(entry) is dict and "tensor" in entry:  # the tensors come in order, each once
            expect(set(entry) == {"tensor"} and type(entry["tensor"]) is int
                    and entry["tensor"] == placed < len(tensors),
                    f"tensor {placed} of the {len(tensors)} that came with the structure", entry)
            leaves.append(tensors[placed])
            placed += 1
        else:
            leaves.append(_read_value(entry, 0))
    if placed != len(tensors):
        raise StructureError(f"expected the structure to place the {len(tensors)} tensors "
                             f"that came with it, got {placed} placed")
    remaining = iter(leaves)
    payload = _build(document["tree"], remaining, 0)
    extra = sum(1 for _ in remaining)
    if extra:
        raise StructureError(f"expected a tree with a place for each of the {len(leaves)} "
                             f"leaves, got {extra} left over")
    return payload


def _build(data: Any, leaves: Iterator[Any], depth: int) -> Any:
    if data is None:
        leaf = next(leaves, _MISSING)
        if leaf is _MISSING:
            raise StructureError("expected as many leaves as the tree has places, got fewer")
        return leaf
    expect(depth < MAX_DEPTH, f"at most {MAX_DEPTH} nested containers", "more")
    expect(type(data) is dict and type(data.get("node")) is str, "a tree node", data)
    kind = data["node"]
    expect(kind in _NODE_FIELDS, f"a node kind among {sorted(_NODE_FIELDS)}", kind)
    fields = _NODE_FIELDS[kind]
    expect(set(data) == fields and type(data["children"]) is list,
            f"a {kind} node with the fields {sorted(fields)}", data)
    children = [_build(child, leaves, depth + 1) for child in data["children"]]
    if kind == "tuple":
        return tuple(children)
    if kind == "list":
        return children
    if kind in ("dict", "OrderedDict"):
        keys = data["keys"]
        expect(type(keys) is list and len(keys) == len(children)
                and all(type(k) in (str, int) for k in keys) and len(set(keys)) == len(keys),
                f"{len(children)} distinct str or int keys", keys)
        return (dict if kind == "dict" else OrderedDict)(zip(keys, children))
    cls = _known_class(data["class"], kind)
    if kind == "namedtuple":
        expect(len(cls._fields) == len(children), f"{len(cls._fields)} fields for "
                f"{data['class']}", len(children))
    else:
        context = _read_value(data["context"], 0)
    try:
        if kind == "namedtuple":
            return cls(*children)
        return pytree.SUPPORTED_NODES[cls].unflatten_fn(children, context)
    except Exception as error:  # the class's own code refused what the peer sent
        raise StructureError(f"could not rebuild {data['class']} from what was sent: "
                             f"{type(error).__name__}: {error}") from error


_MISSING = object()
_NODE_FIELDS = {
    "tuple": {"node", "children"},
    "list": {"node", "children"},
    "dict": {"node", "keys", "children"},
    "OrderedDict": {"node", "keys", "children"},
    "namedtuple": {"node", "class", "children"},
    "registered": {"node", "class", "context", "children"},
}


def _known_class(name: Any, kind: str) -> Any:
    expect(type(name) is str, "a class name", name)
    cls = find_class(name)
    if cls is None:
        raise StructureError(f"expected the name of a class in a module already imported on "
                             f"this rank, got {short(name)}: import the module that defines it "
                             f"before the step (nothing is imported on a peer's word)")
    if kind == "namedtuple":
        expect(issubclass(cls, tuple) and hasattr(cls, "_fields")
                and type(cls._fields) is tuple, "a namedtuple class", name)
    else:
        expect(cls in pytree.SUPPORTED_NODES and cls is not defaultdict
                and cls not in pytree.CONSTANT_NODES,
                "a class registered as a pytree node on this rank", name)
    return cls


def _read_value(data: Any, depth: int) -> Any:
    if data is None or type(data) in (bool, int, str):
        return data
    expect(depth < MAX_DEPTH, f"at most {MAX_DEPTH} nested containers", "more")
    expect(type(data) is dict and len(data) == 1, "a value (null, true, false, an int, a "
            "string, or an object tagged float, complex, tuple, list or dict)", data)
    (tag, body), = data.items()
    if tag == "float":
        return _read_float(body)
    if tag == "complex":
        expect(type(body) is list and len(body) == 2, "[real, imaginary]", body)
        return complex(_read_float(body[0]), _read_float(body[1]))
    if tag in ("tuple", "list"):
        expect(type(body) is list, f"a {tag} of values", body)
        items = [_read_value(item, depth + 1) for item in body]
        return tuple(items) if tag == "tuple" else items
    expect(tag == "dict" and type(body) is list, "a value tagged float, complex, tuple, list "
            "or dict", data)
    pairs = []
    for pair in body:
        expect(type(pair) is list and len(pair) == 2 and type(pair[0]) in (str, int),
                "a [str or int key, value] pair", pair)
        pairs.append((pair[0], _read_value(pair[1], depth + 1)))
    result = dict(pairs)
    expect(len(result) == len(pairs), "distinct dict keys", [key for key, _ in pairs])
    return result


def _read_float(text: Any) -> float:
    expect(type(text) is str and len(text) <= 32, "a float as float.hex() text", text)
    try:
        return float.fromhex(text)
    except (ValueError, OverflowError) as error:
        raise StructureError(f"expected a float as float.hex() text, got {short(text)}: "
                             f"{error}") from error


def _refuse_number(text: str) -> Any:
    raise StructureError(f"expected floats as tagged float.hex() text, got the bare number {text}")
