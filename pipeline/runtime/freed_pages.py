"""Host memory between a step's actions: glibc asked to keep the pages it is given back.

On a GPU, PyTorch's caching allocator keeps freed blocks for the next allocation. On CPU,
tensors come from the C library's ``malloc``, and glibc by default returns freed memory to
the system: the top of its heap past ``M_TRIM_THRESHOLD``, and every block above
``M_MMAP_THRESHOLD`` at once. A pipeline frees and allocates the same sizes action after
action, so each action would pay page faults on memory the last one gave back; a split
backward pays most, since what I keeps for W pushes I's other buffers onto such memory
(about 220 faults, 0.45 ms of a 6 ms backward, per I on a two-block GPT stage).

``keep_freed_pages`` sets both thresholds, as ``MALLOC_TRIM_THRESHOLD_`` and
``MALLOC_MMAP_THRESHOLD_`` would from the environment (and as torch's own CPU launcher
configures jemalloc): no trimming, and blocks up to 32 MiB (glibc's largest) taken from the
heap and kept there. A CPU process then holds the memory of its largest step until it ends,
as a GPU process holds its cached blocks. Left alone: where the C library is not glibc,
where the environment sets either variable (the user chose), and where
``PIPESCHED_KEEP_PAGES=0``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

_TRIM_THRESHOLD, _MMAP_THRESHOLD = -1, -3  # mallopt's M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int
_LARGEST_HEAP_BLOCK = 32 << 20  # glibc refuses a larger M_MMAP_THRESHOLD on 64-bit
OPT_OUT = "PIPESCHED_KEEP_PAGES"
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


@functools.cache
def keep_freed_pages() -> bool:
    """Ask glibc to keep freed memory for the next allocation, once a process. True where
    it now does, False where it was left alone (see the module's docstring for when)."""
    if os.environ.get(OPT_OUT, "1") == "0" or any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (glibc's own: absent from other C libraries)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_TRIM_THRESHOLD, _NEVER_TRIM)) and bool(
        mallopt(_MMAP_THRESHOLD, _LARGEST_HEAP_BLOCK))
