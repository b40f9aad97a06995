"""Old import paths, kept until ``pipeline/pipe.py`` imports from the new ones (then this goes).

``Sample`` and ``split_sample`` live in ``pipeline.compute.sample``, beside the loss.
``refuse_old_keywords`` no longer refuses anything: a keyword ``Pipe`` does not take is
Python's own ``TypeError``, which names it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pipeline.compute.sample import Sample, split_sample

F = TypeVar("F", bound=Callable[..., None])

__all__ = ["Sample", "refuse_old_keywords", "split_sample"]


def refuse_old_keywords(init: F) -> F:
    """``init`` itself (the decorator ``pipe.py`` still applies, until it drops it)."""
    return init
