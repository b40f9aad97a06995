"""Pickles that would run code where pickle is trusted: what the no-pickle tests send receivers."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Evil:
    """An object whose unpickling would create ``path``."""

    def __init__(self, path: str | Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (str(self.path), "w"))


def hostile_pickles(folder: Path, nest: Callable[[Evil], Any]) -> tuple[Path, list[bytes]]:
    """The file the pickles would create (under ``folder``), and the pickles: an ``Evil``,
    the same at protocol 0, and ``nest(evil)`` at protocol 0. First, proof that the gadget
    works where pickle is trusted: it creates a file."""
    proof = folder / "proof"
    pickle.loads(pickle.dumps(Evil(proof)))
    assert proof.exists()
    target = folder / "created"
    return target, [pickle.dumps(Evil(target)), pickle.dumps(Evil(target), protocol=0),
                    pickle.dumps(nest(Evil(target)), protocol=0)]
