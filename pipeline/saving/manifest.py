"""The manifest of a checkpoint: its index and a digest of every file the save wrote.

``.checkpoint.json`` holds DCP's index as checked plain data (``pipeline.saving.format``),
the size and SHA-256 of every file the save wrote (``.metadata`` included), and a SHA-256
of itself. Loading reads the manifest, never ``.metadata`` (DCP's pickle, kept so that
DCP's own tools can read the directory), and checks each file against its digest before
reading it: a flipped byte or an emptied file is an error naming the file.

Every file is read as a regular file of the directory, never through a symbolic link (a
data file replaced by a link to a file elsewhere is refused, even with the very bytes that
were saved) nor as a FIFO or device (whose read could wait forever). The real size of every
file the manifest names is compared with the size it records, and every claimed extent
with those sizes (``pipeline.saving.bounds``), before a load allocates anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from pipeline.saving.bounds import check_extents
from pipeline.saving.format import (
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


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _not_regular(path: Path, mode: int) -> CheckpointError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    if kind == "a symbolic link":
        return CheckpointError(
            f"{path} is a symbolic link (to {os.readlink(path)}): a checkpoint's files are read "
            f"from its own directory only, never through a link to a file elsewhere; copy the "
            f"file into the checkpoint, or save it again")
    return CheckpointError(f"{path} is {kind}, not a file of the checkpoint (a save writes "
                           f"regular files): the checkpoint is corrupt or was modified")


def regular_size(path: Path) -> int:
    """The size of ``path``, a regular file and not a link; CheckpointError otherwise."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint was saved with it") from None
    except OSError as error:
        raise CheckpointError(f"{path} cannot be read: {error.strerror or error}") from error
    if not stat.S_ISREG(found.st_mode):
        raise _not_regular(path, found.st_mode)
    return found.st_size


@contextmanager
def open_regular(path: Path) -> Iterator[Any]:
    """``path`` opened for reading, refused as ``regular_size`` refuses, also when it was
    swapped for a link or a FIFO since it was looked at (O_NOFOLLOW, O_NONBLOCK)."""
    regular_size(path)
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise CheckpointError(f"{path} cannot be read: {error.strerror or error} (it changed "
                              f"while it was read, or is not a regular file)") from error
    with os.fdopen(handle, "rb") as stream:
        mode = os.fstat(handle).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        yield stream


def digest(path: Path) -> dict[str, Any]:
    """The size and SHA-256 of the file at ``path`` (a regular file, not a link)."""
    hashed, size = hashlib.sha256(), 0
    with open_regular(path) as stream:
        while block := stream.read(CHUNK_BYTES):
            hashed.update(block)
            size += len(block)
    return {"bytes": size, "sha256": hashed.hexdigest()}


def _differs(path: Path, found: int, saved: int) -> CheckpointError:
    return CheckpointError(f"{path} is not the file that was saved ({found} bytes where "
                           f"{saved} were saved): the checkpoint is corrupt or was modified")


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
    if not os.path.lexists(path):
        raise CheckpointError(
            f"{directory} has no {MANIFEST_FILE} (the digests of its files and its index): "
            f"it was not written by this version's save_checkpoint (an older version, or "
            f"torch.distributed.checkpoint itself), and its {METADATA_FILE} is a pickle that "
            f"pipesched does not unpickle; save it again with save_checkpoint")
    if regular_size(path) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes: not a manifest")
    with open_regular(path) as stream:
        text = stream.read(MAX_MANIFEST_BYTES + 1)

    def refuse(text: str) -> Any:
        raise StructureError(f"expected ints and strings only, got {short(text)}")

    try:
        document = load_document(text, "a checkpoint manifest",
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
    check_extents(metadata, _sizes(directory, files), str(path))
    return metadata, files


def _sizes(directory: Path, files: dict[str, dict[str, Any]]) -> dict[str, int]:
    """The real size of every file ``files`` names, which must be the size it records."""
    sizes = {}
    for name, entry in sorted(files.items()):
        sizes[name] = regular_size(directory / name)
        if sizes[name] != entry["bytes"]:
            raise _differs(directory / name, sizes[name], entry["bytes"])
    return sizes


def verify(directory: Path, files: dict[str, dict[str, Any]], names: Sequence[str]) -> None:
    """Raise CheckpointError naming the first of ``names`` whose bytes are not what was saved."""
    for name in sorted(set(names)):
        path = directory / name
        found, saved = digest(path), files[name]
        if found["bytes"] != saved["bytes"]:
            raise _differs(path, found["bytes"], saved["bytes"])
        if found != saved:
            raise CheckpointError(f"{path} is not the file that was saved (its SHA-256 digest "
                                  f"differs): the checkpoint is corrupt or was modified")
