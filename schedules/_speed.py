"""Hot-loop support: pause the cyclic garbage collector while a loop allocates per action, and
name the ops without the enum's attribute lookup."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

from schedules.action import Op


@contextmanager
def gc_paused() -> Iterator[None]:
    """Run the body with the cyclic GC off (the loops build no cycles; at 10^5 actions,
    repeated collections of the growing live set cost a third of the time)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# Op's members as module names, for the hot loops (the dependency rule, replays, generators,
# the simulator). In Python 3.11 ``Op.F`` is a lookup through the enum's metaclass, about
# 0.4 us, a global name 0.05 us, and a sweep of schedules looks members up millions of times
# (dependency_keys: 1.9 -> 0.7 us a call).
OP_F, OP_B, OP_I, OP_W = Op.F, Op.B, Op.I, Op.W
