"""Host memory between a step's actions: glibc asked to keep the pages it is given back, on request.

On a GPU, PyTorch's caching allocator keeps freed blocks for the next allocation. On CPU,
tensors come from the C library's ``malloc``, and glibc by default returns freed memory to
the system: the top of its heap past ``M_TRIM_THRESHOLD``, and every block above
``M_MMAP_THRESHOLD`` at once. A pipeline frees and allocates the same sizes action after
action, so each action pays page faults on memory the last one gave back; a split
backward pays most, since what I keeps for W pushes I's other buffers onto such memory
(about 220 faults, 0.45 ms of a 6 ms backward, per I on a two-block GPT stage).

A ``Pipe`` never changes malloc: the setting is the whole process's, and the process is
the user's. ``keep_freed_pages()`` is the opt-in: it sets both thresholds, as
``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_MMAP_THRESHOLD_`` would from the environment (and
as torch's own CPU launcher configures jemalloc): no trimming, and blocks up to 32 MiB
(glibc's largest) taken from the heap and kept there.

How long it lasts: until the process ends. It is process-wide (every thread, every
tensor, the user's own included), and nothing undoes it: glibc starts with *dynamic*
thresholds (the mmap threshold rises to the size of each mapped block freed, the trim
threshold follows at twice that), and a ``mallopt`` call switches that adjustment off for
good; there is no call that switches it back on, and setting the default values again
would leave them fixed, not dynamic. So the process holds the memory of its largest step
until it ends, as a GPU process holds its cached blocks (measured: after 1 GiB of tensors
is freed, RSS stays 1 GiB higher; without the opt-in it returns to where it was).

Left alone, and the call returns False: where the C library is not glibc, and where the
environment sets either variable (the user chose). Measuring with glibc's own behaviour is
simply not calling it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

_TRIM_THRESHOLD, _MMAP_THRESHOLD = -1, -3  # mallopt's M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int
_LARGEST_HEAP_BLOCK = 32 << 20  # glibc refuses a larger M_MMAP_THRESHOLD on 64-bit
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


@functools.cache
def keep_freed_pages() -> bool:
    """Ask glibc to keep the memory the process frees for its next allocations (opt-in).

    Call it once, early, in a process that runs CPU stages and wants steady step times
    (benchmarks do). It changes the whole process until it ends: see
    ``pipeline.runtime.freed_pages`` for why glibc cannot be put back as it was. Later calls
    return the first call's answer and change nothing.

    Returns:
        True where glibc now keeps freed pages; False where malloc was left alone (a C
        library other than glibc, or ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_MMAP_THRESHOLD_``
        set in the environment).
    """
    if any(name in os.environ for name in USER_SETTINGS):
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
