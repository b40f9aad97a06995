"""DCP's plans and metadata as checked plain data: what crosses ranks and what the manifest holds.

``torch.distributed.checkpoint`` coordinates a save by gathering each rank's plan and
write results as pickled objects, and records the checkpoint's index (``.metadata``) as a
pickle. Pickle runs code from its bytes, and both the bytes a peer sends and the files of
a checkpoint are input. Here the same objects are written as plain data (dicts, lists,
strings and ints) that ``pipeline.payloads`` carries between ranks and JSON stores on
disk, and rebuilt only after every field was checked: a dtype among torch's, sizes as
non-negative ints, a data file named as DCP names them, no stream transforms. A value
that does not fit is a ``CheckpointError`` naming where it went wrong.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
# DCP's reader looks a file slice up as its private _StorageInfo: built here, from checked fields.
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from pipeline.payloads.checked_json import short

DATA_FILE = re.compile(r"__\d{1,9}_\d{1,9}\.distcp")  # what DCP's FileSystemWriter names
DTYPES = {str(value).removeprefix("torch."): value for value in vars(torch).values()
          if isinstance(value, torch.dtype)}
MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format,
                  "channels_last": torch.channels_last, "preserve_format": torch.preserve_format}


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked: corrupt, of another model or
    optimizer, or a rank that failed; the message says which file, key or rank."""


# -- checks ------------------------------------------------------------------------------------


def fail(where: str, expected: str, given: Any) -> CheckpointError:
    return CheckpointError(f"{where}: expected {expected}, got {short(given)}")


def as_int(value: Any, where: str) -> int:
    if type(value) is not int or value < 0 or value.bit_length() > 62:
        raise fail(where, "a non-negative int", value)
    return value


def _ints(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > 64:
        raise fail(where, "a list of at most 64 ints", value)
    return tuple(as_int(item, f"{where}[{i}]") for i, item in enumerate(value))


def as_str(value: Any, where: str) -> str:
    if type(value) is not str:
        raise fail(where, "a string", value)
    return value


def _bool(value: Any, where: str) -> bool:
    if type(value) is not bool:
        raise fail(where, "true or false", value)
    return value


def as_dict(value: Any, where: str, keys: Sequence[str]) -> dict[str, Any]:
    if not isinstance(value, dict) or sorted(value) != sorted(keys):
        raise fail(where, f"an object with the keys {', '.join(keys)}", value)
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise fail(where, "a list", value)
    return list(value)


def data_file(value: Any, where: str) -> str:
    """``value`` when it names a data file as DCP's writer does (no directory, no ``..``)."""
    name = as_str(value, where)
    if not DATA_FILE.fullmatch(name):
        raise fail(where, "a data file named like __0_0.distcp", name)
    return name


# -- the pieces --------------------------------------------------------------------------------


def _chunk_plain(chunk: ChunkStorageMetadata) -> dict[str, Any]:
    return {"offsets": list(chunk.offsets), "sizes": list(chunk.sizes)}


def _chunk(value: Any, where: str) -> ChunkStorageMetadata:
    fields = as_dict(value, where, ("offsets", "sizes"))
    offsets, sizes = _ints(fields["offsets"], f"{where}.offsets"), _ints(fields["sizes"],
                                                                       f"{where}.sizes")
    if len(offsets) != len(sizes):
        raise fail(where, "as many offsets as sizes", value)
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def _properties_plain(properties: TensorProperties) -> dict[str, Any]:
    formats = {value: name for name, value in MEMORY_FORMATS.items()}
    if properties.layout != torch.strided or properties.memory_format not in formats:
        raise CheckpointError(f"a checkpoint holds strided tensors, got layout "
                              f"{properties.layout} and memory format {properties.memory_format}")
    return {"dtype": str(properties.dtype).removeprefix("torch."),
            "requires_grad": bool(properties.requires_grad),
            "memory_format": formats[properties.memory_format],
            "pin_memory": bool(properties.pin_memory)}


def _properties(value: Any, where: str) -> TensorProperties:
    fields = as_dict(value, where, ("dtype", "requires_grad", "memory_format", "pin_memory"))
    dtype = as_str(fields["dtype"], f"{where}.dtype")
    memory_format = as_str(fields["memory_format"], f"{where}.memory_format")
    if dtype not in DTYPES:
        raise fail(f"{where}.dtype", "one of torch's dtypes", dtype)
    if memory_format not in MEMORY_FORMATS:
        raise fail(f"{where}.memory_format", f"one of {', '.join(MEMORY_FORMATS)}",
                    memory_format)
    return TensorProperties(dtype=DTYPES[dtype], layout=torch.strided,
                            requires_grad=_bool(fields["requires_grad"], f"{where}.requires_grad"),
                            memory_format=MEMORY_FORMATS[memory_format],
                            pin_memory=_bool(fields["pin_memory"], f"{where}.pin_memory"))


def _index_plain(index: MetadataIndex) -> dict[str, Any]:
    return {"fqn": index.fqn, "offset": None if index.offset is None else list(index.offset),
            "index": index.index}


def _index(value: Any, where: str) -> MetadataIndex:
    fields = as_dict(value, where, ("fqn", "offset", "index"))
    offset = None if fields["offset"] is None else _ints(fields["offset"], f"{where}.offset")
    hint = None if fields["index"] is None else as_int(fields["index"], f"{where}.index")
    return MetadataIndex(as_str(fields["fqn"], f"{where}.fqn"), offset, hint)


def _mappings_plain(mappings: Any) -> dict[str, list[Any]]:
    return {key: list(path) for key, path in (mappings or {}).items()}


def _mappings(value: Any, where: str) -> dict[str, tuple[str | int, ...]]:
    if not isinstance(value, dict):
        raise fail(where, "an object of paths", value)
    paths: dict[str, tuple[str | int, ...]] = {}
    for key, path in value.items():
        steps = _list(path, f"{where}[{key!r}]")
        if not steps or any(type(step) not in (str, int) for step in steps):
            raise fail(f"{where}[{key!r}]", "a non-empty path of strings and ints", path)
        paths[as_str(key, where)] = tuple(steps)
    return paths


def _storage_plain(info: _StorageInfo) -> dict[str, Any]:
    if info.transform_descriptors:
        raise CheckpointError(f"a checkpoint is written without stream transforms, got "
                              f"{list(info.transform_descriptors)}")
    return {"file": info.relative_path, "at": info.offset, "length": info.length}


def _storage(value: Any, where: str) -> _StorageInfo:
    fields = as_dict(value, where, ("file", "at", "length"))
    return _StorageInfo(data_file(fields["file"], f"{where}.file"), as_int(fields["at"],
                        f"{where}.at"), as_int(fields["length"], f"{where}.length"))


# -- plans and results, between ranks ----------------------------------------------------------


def plan_plain(plan: SavePlan) -> dict[str, Any]:
    """A rank's local save plan (before the global step) as plain data."""
    if plan.storage_data is not None or not plan.usable:
        raise CheckpointError("a local save plan carries no storage data and is usable")
    items = []
    for item in plan.items:
        tensor = item.tensor_data
        items.append({
            "index": _index_plain(item.index), "type": item.type.name,
            "nbytes": None if item.bytes_io_data is None else item.bytes_io_data.nbytes,
            "tensor": None if tensor is None else {
                "chunk": _chunk_plain(tensor.chunk), "properties": _properties_plain(
                    tensor.properties), "size": list(tensor.size)}})
    return {"items": items, "mappings": _mappings_plain(plan.planner_data)}


def plan_from_plain(value: Any, where: str) -> SavePlan:
    """A peer's save plan, rebuilt after every field was checked."""
    fields = as_dict(value, where, ("items", "mappings"))
    items = []
    for i, raw in enumerate(_list(fields["items"], f"{where}.items")):
        at = f"{where}.items[{i}]"
        item = as_dict(raw, at, ("index", "type", "nbytes", "tensor"))
        kind = as_str(item["type"], f"{at}.type")
        if kind not in WriteItemType.__members__:
            raise fail(f"{at}.type", f"one of {', '.join(WriteItemType.__members__)}", kind)
        is_bytes = WriteItemType[kind] == WriteItemType.BYTE_IO
        if is_bytes != (item["tensor"] is None) or (not is_bytes and item["nbytes"] is not None):
            raise fail(at, "bytes, or a tensor with its chunk", raw)
        tensor = None
        if not is_bytes:
            data = as_dict(item["tensor"], f"{at}.tensor", ("chunk", "properties", "size"))
            tensor = TensorWriteData(chunk=_chunk(data["chunk"], f"{at}.tensor.chunk"),
                                     properties=_properties(data["properties"],
                                                            f"{at}.tensor.properties"),
                                     size=torch.Size(_ints(data["size"], f"{at}.tensor.size")))
        items.append(WriteItem(
            index=_index(item["index"], f"{at}.index"), type=WriteItemType[kind],
            bytes_io_data=None if item["nbytes"] is None else BytesIOWriteData(
                as_int(item["nbytes"], f"{at}.nbytes")),
            tensor_data=tensor))
    return SavePlan(items, planner_data=_mappings(fields["mappings"], f"{where}.mappings"))


def shares_plain(local: Sequence[SavePlan], merged: Sequence[SavePlan]) -> list[dict[str, Any]]:
    """What the first rank tells each rank of the merged plan: the positions of its local
    plan's items that it writes (replicas' duplicates are written once) and their index
    hints, as DCP's global plan rewrote them (None: none). A few ints an item."""
    shares = []
    for rank, (plan, final) in enumerate(zip(local, merged)):
        kept: list[int] = []
        hints: list[int | None] = []
        items = iter(enumerate(plan.items))
        for item in final.items:
            position = next((p for p, candidate in items if candidate.index == item.index), None)
            if position is None:
                raise CheckpointError(f"rank {rank}'s merged save plan holds {item.index.fqn}, "
                                      f"which its own plan does not hold in that order")
            kept.append(position)
            hints.append(item.index.index)
        shares.append({"kept": kept, "hints": hints})
    return shares


def share_from_plain(value: Any, items: int, where: str) -> list[tuple[int, int | None]]:
    """A rank's share of the merged plan, from the first rank: (position, hint) per item it
    writes, positions increasing and below ``items`` (its local plan's length)."""
    fields = as_dict(value, where, ("kept", "hints"))
    kept, hints = _list(fields["kept"], f"{where}.kept"), _list(fields["hints"], f"{where}.hints")
    if len(kept) != len(hints) or len(kept) > items:
        raise fail(where, f"as many hints as positions, at most {items}", value)
    found: list[tuple[int, int | None]] = []
    for i, (position, hint) in enumerate(zip(kept, hints)):
        position = as_int(position, f"{where}.kept[{i}]")
        if position >= items or (found and position <= found[-1][0]):
            raise fail(f"{where}.kept[{i}]", f"an increasing position below {items}", position)
        found.append((position, None if hint is None else as_int(hint, f"{where}.hints[{i}]")))
    return found


def results_plain(results: Sequence[WriteResult]) -> list[dict[str, Any]]:
    """What a rank wrote, where (DCP's write results) as plain data."""
    return [{"index": _index_plain(result.index), "bytes": result.size_in_bytes,
             "storage": _storage_plain(result.storage_data)} for result in results]


def results_from_plain(value: Any, where: str) -> list[WriteResult]:
    results = []
    for i, raw in enumerate(_list(value, where)):
        fields = as_dict(raw, f"{where}[{i}]", ("index", "bytes", "storage"))
        results.append(WriteResult(index=_index(fields["index"], f"{where}[{i}].index"),
                                   size_in_bytes=as_int(fields["bytes"], f"{where}[{i}].bytes"),
                                   storage_data=_storage(fields["storage"],
                                                         f"{where}[{i}].storage")))
    return results


# -- the index, in the manifest ----------------------------------------------------------------


def metadata_plain(metadata: Metadata) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        entries[key] = None if isinstance(entry, BytesStorageMetadata) else {
            "properties": _properties_plain(entry.properties), "size": list(entry.size),
            "chunks": [_chunk_plain(chunk) for chunk in entry.chunks]}
    storage = [{"index": _index_plain(index), "storage": _storage_plain(info)}
               for index, info in (metadata.storage_data or {}).items()]
    return {"entries": entries, "mappings": _mappings_plain(metadata.planner_data),
            "storage": storage}


def metadata_from_plain(value: Any, where: str) -> Metadata:
    fields = as_dict(value, where, ("entries", "mappings", "storage"))
    if not isinstance(fields["entries"], dict):
        raise fail(f"{where}.entries", "an object", fields["entries"])
    entries: dict[str, BytesStorageMetadata | TensorStorageMetadata] = {}
    for key, raw in fields["entries"].items():
        at = f"{where}.entries[{key!r}]"
        if raw is None:
            entries[key] = BytesStorageMetadata()
            continue
        entry = as_dict(raw, at, ("properties", "size", "chunks"))
        entries[key] = TensorStorageMetadata(
            properties=_properties(entry["properties"], f"{at}.properties"),
            size=torch.Size(_ints(entry["size"], f"{at}.size")),
            chunks=[_chunk(chunk, f"{at}.chunks[{i}]")
                    for i, chunk in enumerate(_list(entry["chunks"], f"{at}.chunks"))])
    storage = {}
    for i, raw in enumerate(_list(fields["storage"], f"{where}.storage")):
        entry = as_dict(raw, f"{where}.storage[{i}]", ("index", "storage"))
        storage[_index(entry["index"], f"{where}.storage[{i}].index")] = _storage(
            entry["storage"], f"{where}.storage[{i}].storage")
    mappings = _mappings(fields["mappings"], f"{where}.mappings")
    if set(mappings) != set(entries):
        raise fail(f"{where}.mappings", "a path for every entry", sorted(set(mappings)
                                                                        ^ set(entries)))
    return Metadata(state_dict_metadata=entries, planner_data=mappings, storage_data=storage)
