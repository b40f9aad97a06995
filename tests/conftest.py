"""The quick tier: tests that start processes or run long are marked ``slow``, here, in one place.

``pytest -m "not slow"`` runs the rest: the tests that run inside pytest's own process
(schedules, partitioners, single-process Pipes, the doctests) in a few minutes on 2
cores. ``pytest`` alone runs everything, and stays the check before a commit.

A test is slow when it

- starts processes: it reaches ``run_ranks``/``run_ranks_raw`` (gloo ranks), ``subprocess``
  (the CLI, mypy, examples, torchrun) or ``nbclient`` (notebooks), itself, through a
  helper or a fixture. The code is read, not the file name, so a test keeps its tier
  when its file moves or a helper moves to another file;
- or it is in ``MEASURED`` below: single-process tests measured at several seconds.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent

# Names whose use means another process: the spawn harness, subprocesses, notebook kernels.
PROCESS_NAMES = frozenset({"run_ranks", "run_ranks_raw", "subprocess", "nbclient"})

# Single-process tests that each took several seconds on 2 loaded cores (pytest
# --durations), by file name and test name so that they survive a move to another folder.
# Remeasure with:  pytest -m "not slow" -p no:randomly --durations=30
MEASURED = frozenset({
})


def pytest_configure(config: pytest.Config) -> None:
    # Registered in setup.cfg too; here as well so that a run from another ini still knows it.
    config.addinivalue_line("markers", "slow: starts processes or runs long; "
                                       "pytest -m 'not slow' is the quick tier")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    seen: dict[int, bool] = {}
    for item in items:
        if _measured(item) or any(_starts_processes(function, seen)
                                  for function in _functions_of(item)):
            item.add_marker(pytest.mark.slow)


def _measured(item: pytest.Item) -> bool:
    name = getattr(item, "originalname", item.name)
    return f"{Path(str(item.fspath)).name}::{name}" in MEASURED


def _functions_of(item: pytest.Item) -> Iterator[Callable[..., Any]]:
    """The test function and the functions of the fixtures it uses, by argument or by a
    parameter naming one (``request.getfixturevalue(name)``)."""
    function = getattr(item, "function", None)
    if function is None:  # a doctest: it runs in this process
        return
    yield function
    info = getattr(item, "_fixtureinfo", None)
    for definitions in getattr(info, "name2fixturedefs", {}).values():
        for definition in definitions:
            yield definition.func
    callspec = getattr(item, "callspec", None)
    manager = item.session._fixturemanager
    for value in (callspec.params.values() if callspec is not None else ()):
        if isinstance(value, str):
            for definition in manager.getfixturedefs(value, item) or ():
                yield definition.func


def _starts_processes(function: Any, seen: dict[int, bool]) -> bool:
    """Whether ``function``'s code names a process starter, or calls test code that does."""
    function = inspect.unwrap(function)  # functools.cache, decorators with @wraps
    code = getattr(function, "__code__", None)
    if code is None or not _is_test_code(code):
        return False
    if id(code) in seen:
        return seen[id(code)]
    seen[id(code)] = False  # recursion (a helper calling itself) adds nothing
    names = set(_names(code))
    found = bool(names & PROCESS_NAMES)
    if not found:
        scope = getattr(function, "__globals__", {})
        found = any(_starts_processes(scope[name], seen) for name in names
                    if callable(scope.get(name)) and not isinstance(scope[name], type))
    seen[id(code)] = found
    return found


def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):  # nested functions, lambdas, comprehensions
            yield from _names(constant)


def _is_test_code(code: types.CodeType) -> bool:
    return Path(code.co_filename).resolve().is_relative_to(TESTS)
