"""Every size and offset a manifest claims, checked against the files' real sizes.

A manifest is input: whoever can write the directory can sign a consistent one. Loading
allocates a placeholder of each entry's claimed size (an optimizer's state tensor) and
DCP seeks to each claimed offset and reads the claimed length. So before anything is
allocated or read, every stored slice must lie inside its file, every chunk inside its
tensor, and every tensor's claimed bytes must be covered by the bytes stored for it: what
a load allocates is then bounded by the checkpoint's size on disk.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from pipeline.saving.format import CheckpointError, fail

_CORRUPT = "the manifest is corrupt or was modified"


def check_extents(metadata: Metadata, sizes: Mapping[str, int], where: str) -> None:
    """Raise CheckpointError where ``metadata`` claims bytes its files (``sizes``) lack.

    Args:
        metadata: the checked index, read from the manifest at ``where``.
        sizes: the real size of every data file it names, in bytes.
        where: the manifest, for the messages.
    """
    stored: dict[tuple[str, tuple[int, ...] | None], int] = {}
    for index, info in (metadata.storage_data or {}).items():
        end, size = info.offset + info.length, sizes[info.relative_path]
        if end > size:
            raise CheckpointError(
                f"{where}: {index.fqn} is stored at bytes {info.offset} to {end} of "
                f"{info.relative_path}, past its end ({size} bytes): {_CORRUPT}")
        offset = None if index.offset is None else tuple(index.offset)
        stored[(index.fqn, offset)] = info.length
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            _check_tensor(key, entry, stored, f"{where}.entries[{key!r}]")


def _check_tensor(key: str, entry: TensorStorageMetadata,
                  stored: Mapping[tuple[str, tuple[int, ...] | None], int], where: str) -> None:
    size, dtype = list(entry.size), entry.properties.dtype
    lengths = []
    for i, chunk in enumerate(entry.chunks):
        offsets, sizes = list(chunk.offsets), list(chunk.sizes)
        if len(offsets) != len(size) or any(o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise fail(f"{where}.chunks[{i}]", f"a chunk inside the tensor's size {size}",
                       {"offsets": offsets, "sizes": sizes})
        length = stored.get((key, tuple(offsets)))
        if length is None:
            raise CheckpointError(f"{where}.chunks[{i}]: no stored bytes for the chunk at "
                                  f"offsets {offsets}: {_CORRUPT}")
        lengths.append((sizes, length))
    claimed, held = math.prod(size) * dtype.itemsize, sum(length for _, length in lengths)
    if claimed > held:
        raise CheckpointError(
            f"{where}: {key} claims {claimed} bytes ({str(dtype).removeprefix('torch.')} "
            f"{size}), more than the {held} bytes stored for it: {_CORRUPT}")
    for sizes, length in lengths:
        if math.prod(sizes) * dtype.itemsize > length:
            raise CheckpointError(
                f"{where}: {key}'s chunk of size {sizes} claims "
                f"{math.prod(sizes) * dtype.itemsize} bytes, more than the {length} bytes "
                f"stored for it: {_CORRUPT}")
