"""The manifest of a checkpoint: its index and a digest of every file the save wrote.

``.checkpoint.json`` holds DCP's index as checked plain data (``pipeline.checkpointing.format``),
the size and SHA-256 of every file the save wrote (``.metadata`` included), and a SHA-256
of itself. Loading reads the manifest, never ``.metadata`` (DCP's pickle, kept so that
DCP's own tools can read the directory), and checks each file against its digest before
reading it: a flipped byte or an emptied file is an error naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from pipeline.checkpointing.format import (
    CheckpointError,
    as_dict,
    as_int,
    as_str,
    data_file,
    fail,
    metadata_from_plain,
    metadata_plain,
)
from pipeline.payloads.checked_json import StructureError, load_document, short

MANIFEST_FILE = ".checkpoint.json"
METADATA_FILE = ".metadata"  # DCP's pickled index: digested, never read back here
MANIFEST_FORMAT = 1
MAX_MANIFEST_BYTES = 1 << 28
CHUNK_BYTES = 1 << 20


def digests_from_plain(value: Any, rank: int) -> dict[str, dict[str, Any]]:
    """The digests of the files rank ``rank`` says it wrote: its own data files only."""
    where = f"rank {rank}'s file digests"
    if not isinstance(value, dict):
        raise fail(where, "an object", value)
    files = {}
    for name, entry in value.items():
        if not data_file(name, where).startswith(f"__{rank}_"):
            raise fail(where, f"files of rank {rank} (__{rank}_*.distcp)", name)
        files[name] = _digest_entry(entry, f"{where}[{name!r}]")
    return files


def _digest_entry(value: Any, where: str) -> dict[str, Any]:
    checked = as_dict(value, where, ("bytes", "sha256"))
    as_int(checked["bytes"], f"{where}.bytes")
    if not re.fullmatch(r"[0-9a-f]{64}", as_str(checked["sha256"], f"{where}.sha256")):
        raise fail(f"{where}.sha256", "64 hex digits", checked["sha256"])
    return {"bytes": checked["bytes"], "sha256": checked["sha256"]}


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
    fields = as_dict(body, f"{path}", ("metadata", "files"))
    files = {}
    if not isinstance(fields["files"], dict):
        raise fail(f"{path}.files", "an object", fields["files"])
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
