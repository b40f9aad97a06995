"""Where a save writes: the target checked, held under a lock, and replaced in one step.

A checkpoint is a directory that a save replaces whole, so that a run killed midway leaves
the previous checkpoint: the new one is written into ``.<name>.partial`` beside the target
and swapped in when complete. That swap is why a save never writes *beside* a user's
files: files that are not the checkpoint's would either go with the old directory (deleted)
or stay behind in the new one (a checkpoint that is no longer one directory of its own).
So a save refuses, before it writes a byte, any target that holds something other than a
checkpoint of ours: a user's files, a file, a symbolic link, the current directory or one
above it. An empty directory is taken.

What is "ours" is read from names, never guessed from contents: the manifest, DCP's
``.metadata``, data files named ``__<rank>_<n>.distcp`` and the ``.incomplete`` mark, each a
regular file. A leftover ``.<name>.partial`` (a save that was killed) is removed only when it
holds nothing else; a directory of the user's that happens to have the name is refused.

One save at a time: the first rank takes an advisory lock (``flock``) on ``.<name>.lock``
beside the target for the whole save, so a second process saving to the same path gets a
CheckpointError at once instead of removing the first one's files. The kernel releases the
lock of a process that dies; the lock file is removed by whoever releases it.

The swap is Linux's ``renameat2(RENAME_EXCHANGE)`` (through ctypes: Python's ``os`` has no
flags for it), so the path holds a complete checkpoint at every instant. Where the system
cannot exchange (another OS, some network file systems) the old checkpoint is renamed to
``.<name>.previous`` first, and a reader arriving between the two renames is told where it is.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import socket
import stat
from functools import cache
from pathlib import Path
from typing import Any

from pipeline.saving.format import DATA_FILE, CheckpointError
from pipeline.saving.manifest import MANIFEST_FILE, METADATA_FILE

INCOMPLETE_MARK = ".incomplete"  # inside a directory still being written
OUR_FILES = frozenset({MANIFEST_FILE, METADATA_FILE, INCOMPLETE_MARK})
_SHOWN = 8  # names listed in an error, at most
_LOCK_TRIES = 64


def staging_of(target: Path) -> Path:
    return target.parent / f".{target.name}.partial"


def previous_of(target: Path) -> Path:
    return target.parent / f".{target.name}.previous"


def lock_of(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


def absolute(path: str | os.PathLike[str]) -> Path:
    """``path`` made absolute without following links: ``"."`` gets the name it has."""
    return Path(os.path.abspath(path))


# -- what the target holds ---------------------------------------------------------------------


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "directory"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "file"


def foreign_entries(directory: Path) -> list[str]:
    """The entries of ``directory`` that a save did not write (a sub-directory ends in ``/``)."""
    foreign = []
    with os.scandir(directory) as entries:
        for entry in entries:
            ours = entry.name in OUR_FILES or DATA_FILE.fullmatch(entry.name) is not None
            if not (ours and entry.is_file(follow_symlinks=False)):
                foreign.append(entry.name + ("/" if entry.is_dir(follow_symlinks=False) else ""))
    return sorted(foreign)


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(name) for name in names[:_SHOWN])
    return f"[{shown}{', ...' if len(names) > _SHOWN else ''}]"


def _refuse_foreign(directory: Path, foreign: list[str]) -> CheckpointError:
    return CheckpointError(
        f"{directory} holds files that save_checkpoint did not write: {_listed(foreign)} "
        f"({len(foreign)}); a save replaces the whole directory and never deletes what it did "
        f"not write: save to a directory of its own inside it ({directory / 'checkpoint'}), "
        f"or move those files away")


def check_target(target: Path) -> None:
    """Raise CheckpointError unless ``target`` is absent, empty, or a checkpoint of ours."""
    real, here = Path(os.path.realpath(target)), Path(os.path.realpath(os.getcwd()))
    if here == real or here.is_relative_to(real):
        raise CheckpointError(
            f"cannot save a checkpoint to {target}: it is the current directory or holds it "
            f"({here}), which a save cannot replace; name a directory inside it, as "
            f"save_checkpoint(pipe, optimizer, 'checkpoints/step-100', step)")
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        return
    except OSError as error:
        raise cannot_write(target, error) from error
    if stat.S_ISLNK(mode):
        raise CheckpointError(
            f"{target} is a symbolic link (to {os.readlink(target)}): a save replaces the "
            f"directory at its path and would replace the link, not what it points to; save to "
            f"{real} itself, or to another path")
    if not stat.S_ISDIR(mode):
        raise CheckpointError(
            f"{target} is a {_kind(mode)}, not a checkpoint directory: save_checkpoint writes a "
            f"directory and never replaces what it did not write; choose another path, or "
            f"move the {_kind(mode)} away")
    foreign = _entries(target)
    if foreign:
        raise _refuse_foreign(target, foreign)
    names = os.listdir(target)
    if names and MANIFEST_FILE not in names:
        raise CheckpointError(
            f"{target} holds a checkpoint without {MANIFEST_FILE} (written by plain "
            f"torch.distributed.checkpoint or an earlier pipesched): save_checkpoint replaces "
            f"only its own checkpoints; remove it, or save to another path")


def _entries(directory: Path) -> list[str]:
    try:
        return foreign_entries(directory)
    except OSError as error:
        raise cannot_write(directory, error) from error


def cannot_write(target: Path, error: OSError) -> CheckpointError:
    reason = error.strerror or str(error)
    wrapped = CheckpointError(
        f"cannot write a checkpoint at {target}: {reason} ({type(error).__name__} on "
        f"{error.filename or target}); save to a directory this process can create and write")
    wrapped.__cause__ = error
    return wrapped


def clear_leftover(path: Path) -> None:
    """Remove ``path`` (a killed save's staging or previous directory) if it is ours."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        raise CheckpointError(f"{path} is a {_kind(mode)}, where a save puts its own "
                              f"directory: move it away")
    foreign = foreign_entries(path)
    if foreign:
        raise _refuse_foreign(path, foreign)
    shutil.rmtree(path)


def discard(path: Path) -> None:
    """Remove ``path`` if it is a directory of ours; leave anything else where it is."""
    try:
        clear_leftover(path)
    except (CheckpointError, OSError):
        pass


# -- one save at a time ------------------------------------------------------------------------


class SaveLock:
    """The advisory lock on ``.<name>.lock`` that one save of ``target`` holds throughout."""

    def __init__(self, target: Path) -> None:
        self.target, self.path = target, lock_of(target)
        self.handle: int | None = None

    def take(self) -> SaveLock:
        """Take the lock; CheckpointError when another process holds it."""
        for _ in range(_LOCK_TRIES):
            handle = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o644)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(handle, 200).decode(errors="replace").strip() or "another process"
                os.close(handle)
                raise CheckpointError(
                    f"another save to {self.target} is in progress ({holder} holds {self.path}); "
                    f"wait for it to finish, or save to another path") from None
            if self._still_at_path(handle):
                os.ftruncate(handle, 0)
                os.write(handle, f"process {os.getpid()} on {socket.gethostname()}".encode())
                self.handle = handle
                return self
            os.close(handle)  # a save that finished removed the file we locked: again
        raise CheckpointError(f"could not take {self.path} in {_LOCK_TRIES} tries: saves to "
                              f"{self.target} keep starting; save once at a time")

    def _still_at_path(self, handle: int) -> bool:
        try:
            found = os.lstat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(handle)
        return (found.st_dev, found.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        """Remove the lock file, then let go: a waiting save finds the path free."""
        if self.handle is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self.handle)
            self.handle = None


def take(target: Path) -> SaveLock:
    """Check ``target``, lock it, check again, and clear a killed save's leftovers.

    Nothing is written when ``target`` is refused. Raises CheckpointError."""
    check_target(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = SaveLock(target).take()
    except OSError as error:
        raise cannot_write(target, error) from error
    try:
        check_target(target)  # as it is now that no other save can change it
        for leftover in (staging_of(target), previous_of(target)):
            clear_leftover(leftover)
        staging = staging_of(target)
        staging.mkdir()
        (staging / INCOMPLETE_MARK).write_bytes(b"")
    except BaseException as error:
        lock.release()
        if isinstance(error, OSError):
            raise cannot_write(target, error) from error
        raise
    return lock


# -- putting a finished checkpoint in place ----------------------------------------------------


def publish(staging: Path, target: Path) -> None:
    """Put the finished ``staging`` at ``target`` in one step; the old checkpoint goes after.

    ``target`` is checked again first (a user may have written into it since the save
    began); the old directory is removed only if it still holds nothing but ours."""
    check_target(target)
    (staging / INCOMPLETE_MARK).unlink()
    fsync_directory(staging)
    if not os.path.lexists(target):
        os.rename(staging, target)
    elif exchange(staging, target):
        discard(staging)  # the previous checkpoint, now at the staging path
    else:
        _replace_by_renames(staging, target)
    fsync_directory(target.parent)


def _replace_by_renames(staging: Path, target: Path) -> None:
    """Two renames where the system cannot exchange: the old checkpoint waits beside."""
    previous = previous_of(target)
    os.rename(target, previous)  # a directory cannot replace a non-empty one in one step
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(previous, target)
        raise
    discard(previous)


@cache
def _renameat2() -> Any:
    function = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                             ctypes.c_uint]
        function.restype = ctypes.c_int
    return function


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange(first: Path, second: Path) -> bool:
    """Swap two existing paths atomically; False where the system cannot (nothing moved)."""
    function = _renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second),
                _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


def fsync_directory(directory: Path) -> None:
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not every platform opens directories
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)
