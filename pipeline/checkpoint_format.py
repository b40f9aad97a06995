"""DCP's plans and metadata as checked plain data: what crosses ranks and what the manifest holds.

``torch.distributed.checkpoint`` coordinates a save by gathering each rank's plan and
write results as pickled objects, and records the checkpoint's index (``.metadata``) as a
pickle. Pickle runs code from its bytes, and both the bytes a peer sends and the files of
a checkpoint are input. Here the same objects are written as plain data (dicts, lists,
strings and ints) that ``pipeline.payloads`` carries between ranks and JSON stores on
disk, and rebuilt only after every field was checked: a dtype among torch's, sizes as
non-negative ints, a data file named as DCP names them, no stream transforms. A value
that does not fit is a ``CheckpointError`` naming where it went wrong.

The manifest (``.checkpoint.json``) holds the index and a SHA-256 digest of every file
the save wrote, ``.metadata`` included, and a digest of itself; loading reads the
manifest, never ``.metadata`` (kept so that DCP's own tools can read the directory).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
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

from pipeline.payloads.checked_json import StructureError, load_document, short

MANIFEST_FILE = ".checkpoint.json"
METADATA_FILE = ".metadata"  # DCP's pickled index: digested, never read back here
MANIFEST_FORMAT = 1
MAX_MANIFEST_BYTES = 1 << 28
DATA_FILE = re.compile(r"__\d{1,9}_\d{1,9}\.distcp")  # what DCP's FileSystemWriter names
CHUNK_BYTES = 1 << 20
DTYPES = {str(value).removeprefix("torch."): value for value in vars(torch).values()
          if isinstance(value, torch.dtype)}
MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format,
                  "channels_last": torch.channels_last, "preserve_format": torch.preserve_format}


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked: corrupt, of another model or
    optimizer, or a rank that failed; the message says which file, key or rank."""


# -- checks ------------------------------------------------------------------------------------


def _fail(where: str, expected: str, given: Any) -> CheckpointError:
    return CheckpointError(f"{where}: expected {expected}, got {short(given)}")


def _int(value: Any, where: str) -> int:
    if type(value) is not int or value < 0 or value.bit_length() > 62:
        raise _fail(where, "a non-negative int", value)
    return value


def _ints(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > 64:
        raise _fail(where, "a list of at most 64 ints", value)
    return tuple(_int(item, f"{where}[{i}]") for i, item in enumerate(value))


def _str(value: Any, where: str) -> str:
    if type(value) is not str:
        raise _fail(where, "a string", value)
    return value


def _bool(value: Any, where: str) -> bool:
    if type(value) is not bool:
        raise _fail(where, "true or false", value)
    return value


def _dict(value: Any, where: str, keys: Sequence[str]) -> dict[str, Any]:
    if not isinstance(value, dict) or sorted(value) != sorted(keys):
        raise _fail(where, f"an object with the keys {', '.join(keys)}", value)
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise _fail(where, "a list", value)
    return list(value)


def data_file(value: Any, where: str) -> str:
    """``value`` when it names a data file as DCP's writer does (no directory, no ``..``)."""
    name = _str(value, where)
    if not DATA_FILE.fullmatch(name):
        raise _fail(where, "a data file named like __0_0.distcp", name)
    return name


# -- the pieces --------------------------------------------------------------------------------


def _chunk_plain(chunk: ChunkStorageMetadata) -> dict[str, Any]:
    return {"offsets": list(chunk.offsets), "sizes": list(chunk.sizes)}


def _chunk(value: Any, where: str) -> ChunkStorageMetadata:
    fields = _dict(value, where, ("offsets", "sizes"))
    offsets, sizes = _ints(fields["offsets"], f"{where}.offsets"), _ints(fields["sizes"],
                                                                       f"{where}.sizes")
    if len(offsets) != len(sizes):
        raise _fail(where, "as many offsets as sizes", value)
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
    fields = _dict(value, where, ("dtype", "requires_grad", "memory_format", "pin_memory"))
    dtype = _str(fields["dtype"], f"{where}.dtype")
    memory_format = _str(fields["memory_format"], f"{where}.memory_format")
    if dtype not in DTYPES:
        raise _fail(f"{where}.dtype", "one of torch's dtypes", dtype)
    if memory_format not in MEMORY_FORMATS:
        raise _fail(f"{where}.memory_format", f"one of {', '.join(MEMORY_FORMATS)}",
                    memory_format)
    return TensorProperties(dtype=DTYPES[dtype], layout=torch.strided,
                            requires_grad=_bool(fields["requires_grad"], f"{where}.requires_grad"),
                            memory_format=MEMORY_FORMATS[memory_format],
                            pin_memory=_bool(fields["pin_memory"], f"{where}.pin_memory"))


def _index_plain(index: MetadataIndex) -> dict[str, Any]:
    return {"fqn": index.fqn, "offset": None if index.offset is None else list(index.offset),
            "index": index.index}


def _index(value: Any, where: str) -> MetadataIndex:
    fields = _dict(value, where, ("fqn", "offset", "index"))
    offset = None if fields["offset"] is None else _ints(fields["offset"], f"{where}.offset")
    hint = None if fields["index"] is None else _int(fields["index"], f"{where}.index")
    return MetadataIndex(_str(fields["fqn"], f"{where}.fqn"), offset, hint)


def _mappings_plain(mappings: Any) -> dict[str, list[Any]]:
    return {key: list(path) for key, path in (mappings or {}).items()}


def _mappings(value: Any, where: str) -> dict[str, tuple[str | int, ...]]:
    if not isinstance(value, dict):
        raise _fail(where, "an object of paths", value)
    paths: dict[str, tuple[str | int, ...]] = {}
    for key, path in value.items():
        steps = _list(path, f"{where}[{key!r}]")
        if not steps or any(type(step) not in (str, int) for step in steps):
            raise _fail(f"{where}[{key!r}]", "a non-empty path of strings and ints", path)
        paths[_str(key, where)] = tuple(steps)
    return paths


def _storage_plain(info: _StorageInfo) -> dict[str, Any]:
    if info.transform_descriptors:
        raise CheckpointError(f"a checkpoint is written without stream transforms, got "
                              f"{list(info.transform_descriptors)}")
    return {"file": info.relative_path, "at": info.offset, "length": info.length}


def _storage(value: Any, where: str) -> _StorageInfo:
    fields = _dict(value, where, ("file", "at", "length"))
    return _StorageInfo(data_file(fields["file"], f"{where}.file"), _int(fields["at"],
                        f"{where}.at"), _int(fields["length"], f"{where}.length"))


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
    fields = _dict(value, where, ("items", "mappings"))
    items = []
    for i, raw in enumerate(_list(fields["items"], f"{where}.items")):
        at = f"{where}.items[{i}]"
        item = _dict(raw, at, ("index", "type", "nbytes", "tensor"))
        kind = _str(item["type"], f"{at}.type")
        if kind not in WriteItemType.__members__:
            raise _fail(f"{at}.type", f"one of {', '.join(WriteItemType.__members__)}", kind)
        is_bytes = WriteItemType[kind] == WriteItemType.BYTE_IO
        if is_bytes != (item["tensor"] is None) or (not is_bytes and item["nbytes"] is not None):
            raise _fail(at, "bytes, or a tensor with its chunk", raw)
        tensor = None
        if not is_bytes:
            data = _dict(item["tensor"], f"{at}.tensor", ("chunk", "properties", "size"))
            tensor = TensorWriteData(chunk=_chunk(data["chunk"], f"{at}.tensor.chunk"),
                                     properties=_properties(data["properties"],
                                                            f"{at}.tensor.properties"),
                                     size=torch.Size(_ints(data["size"], f"{at}.tensor.size")))
        items.append(WriteItem(
            index=_index(item["index"], f"{at}.index"), type=WriteItemType[kind],
            bytes_io_data=None if item["nbytes"] is None else BytesIOWriteData(
                _int(item["nbytes"], f"{at}.nbytes")),
            tensor_data=tensor))
    return SavePlan(items, planner_data=_mappings(fields["mappings"], f"{where}.mappings"))


def results_plain(results: Sequence[WriteResult]) -> list[dict[str, Any]]:
    """What a rank wrote, where (DCP's write results) as plain data."""
    return [{"index": _index_plain(result.index), "bytes": result.size_in_bytes,
             "storage": _storage_plain(result.storage_data)} for result in results]


def results_from_plain(value: Any, where: str) -> list[WriteResult]:
    results = []
    for i, raw in enumerate(_list(value, where)):
        fields = _dict(raw, f"{where}[{i}]", ("index", "bytes", "storage"))
        results.append(WriteResult(index=_index(fields["index"], f"{where}[{i}].index"),
                                   size_in_bytes=_int(fields["bytes"], f"{where}[{i}].bytes"),
                                   storage_data=_storage(fields["storage"],
                                                         f"{where}[{i}].storage")))
    return results


def digests_from_plain(value: Any, rank: int) -> dict[str, dict[str, Any]]:
    """The digests of the files rank ``rank`` says it wrote: its own data files only."""
    where = f"rank {rank}'s file digests"
    if not isinstance(value, dict):
        raise _fail(where, "an object", value)
    files = {}
    for name, entry in value.items():
        if not data_file(name, where).startswith(f"__{rank}_"):
            raise _fail(where, f"files of rank {rank} (__{rank}_*.distcp)", name)
        files[name] = _digest_entry(entry, f"{where}[{name!r}]")
    return files


def _digest_entry(value: Any, where: str) -> dict[str, Any]:
    checked = _dict(value, where, ("bytes", "sha256"))
    _int(checked["bytes"], f"{where}.bytes")
    if not re.fullmatch(r"[0-9a-f]{64}", _str(checked["sha256"], f"{where}.sha256")):
        raise _fail(f"{where}.sha256", "64 hex digits", checked["sha256"])
    return {"bytes": checked["bytes"], "sha256": checked["sha256"]}


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
    fields = _dict(value, where, ("entries", "mappings", "storage"))
    if not isinstance(fields["entries"], dict):
        raise _fail(f"{where}.entries", "an object", fields["entries"])
    entries: dict[str, BytesStorageMetadata | TensorStorageMetadata] = {}
    for key, raw in fields["entries"].items():
        at = f"{where}.entries[{key!r}]"
        if raw is None:
            entries[key] = BytesStorageMetadata()
            continue
        entry = _dict(raw, at, ("properties", "size", "chunks"))
        entries[key] = TensorStorageMetadata(
            properties=_properties(entry["properties"], f"{at}.properties"),
            size=torch.Size(_ints(entry["size"], f"{at}.size")),
            chunks=[_chunk(chunk, f"{at}.chunks[{i}]")
                    for i, chunk in enumerate(_list(entry["chunks"], f"{at}.chunks"))])
    storage = {}
    for i, raw in enumerate(_list(fields["storage"], f"{where}.storage")):
        entry = _dict(raw, f"{where}.storage[{i}]", ("index", "storage"))
        storage[_index(entry["index"], f"{where}.storage[{i}].index")] = _storage(
            entry["storage"], f"{where}.storage[{i}].storage")
    mappings = _mappings(fields["mappings"], f"{where}.mappings")
    if set(mappings) != set(entries):
        raise _fail(f"{where}.mappings", "a path for every entry", sorted(set(mappings)
                                                                        ^ set(entries)))
    return Metadata(state_dict_metadata=entries, planner_data=mappings, storage_data=storage)


# -- digests and the manifest ------------------------------------------------------------------


def digest(path: Path) -> dict[str, Any]:
    """The size and SHA-256 of the file at ``path``."""
    hashed, size = hashlib.sha256(), 0
    with open(path, "rb") as stream:
        while block := stream.read(CHUNK_BYTES):
            hashed.update(block)
            size += len(block)
    return {"bytes": size, "sha256": hashed.hexdigest()}


def _canonical(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def write_manifest(directory: Path, metadata: Metadata, files: dict[str, dict[str, Any]]) -> None:
    """Write the manifest: the index, each file's digest, and the manifest's own digest."""
    body = {"metadata": metadata_plain(metadata), "files": files}
    document = {"format": MANIFEST_FORMAT, "body": body,
                "sha256": hashlib.sha256(_canonical(body)).hexdigest()}
    with open(directory / MANIFEST_FILE, "wb") as stream:
        stream.write(json.dumps(document).encode())
        stream.flush()
        os.fsync(stream.fileno())


def read_manifest(directory: Path) -> tuple[Metadata, dict[str, dict[str, Any]]]:
    """The checked index and file digests of the checkpoint at ``directory``.

    Raises:
        CheckpointError: the manifest is missing, too large, not what a save writes, or
            its digest does not match its body.
    """
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{directory} has no {MANIFEST_FILE} (the digests of its files and its index): "
            f"it was not written by this version's save_checkpoint (an older version, or "
            f"torch.distributed.checkpoint itself), and its {METADATA_FILE} is a pickle that "
            f"pipesched does not unpickle; save it again with save_checkpoint")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes: not a manifest")

    def refuse(text: str) -> Any:
        raise StructureError(f"expected ints and strings only, got {short(text)}")

    try:
        document = load_document(path.read_bytes(), "a checkpoint manifest",
                                 ("format", "body", "sha256"), MANIFEST_FORMAT, refuse, refuse)
    except StructureError as error:
        raise CheckpointError(f"{path} is corrupt: {error}") from error
    body = document["body"]
    if hashlib.sha256(_canonical(body)).hexdigest() != document["sha256"]:
        raise CheckpointError(f"{path} is corrupt: its digest does not match its contents")
    fields = _dict(body, f"{path}", ("metadata", "files"))
    files = {}
    if not isinstance(fields["files"], dict):
        raise _fail(f"{path}.files", "an object", fields["files"])
    for name, entry in fields["files"].items():
        if name != METADATA_FILE:
            data_file(name, f"{path}.files")
        files[name] = _digest_entry(entry, f"{path}.files[{name!r}]")
    metadata = metadata_from_plain(fields["metadata"], f"{path}.metadata")
    unlisted = {info.relative_path for info in metadata.storage_data.values()} - set(files)
    if METADATA_FILE not in files or unlisted:
        raise CheckpointError(f"{path} is corrupt: it has no digest for "
                              f"{sorted(unlisted) or [METADATA_FILE]}")
    return metadata, files


def verify(directory: Path, files: dict[str, dict[str, Any]], names: Sequence[str]) -> None:
    """Raise CheckpointError naming the first of ``names`` whose bytes are not what was saved."""
    for name in sorted(set(names)):
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: the checkpoint was saved with it")
        found, saved = digest(path), files[name]
        if found != saved:
            what = (f"{found['bytes']} bytes where {saved['bytes']} were saved"
                    if found["bytes"] != saved["bytes"] else "its SHA-256 digest differs")
            raise CheckpointError(f"{path} is not the file that was saved ({what}): the "
                                  f"checkpoint is corrupt or was modified")
