"""Doctests run once: pytest collects every package's (``--doctest-modules`` over setup.cfg's
``testpaths``), and no test runs them again by hand. Every registered schedule generator
shows its timetable as a doctest, so the picture in its docstring cannot drift from the code.
"""

from __future__ import annotations

import ast
import configparser
import doctest
from pathlib import Path

from schedules import schedule_info, schedule_names

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schedules", "units", "split_backward", "partitioners", "pipeline")
# Ways to run a doctest by hand; collection by pytest is the one way this project uses.
BY_HAND = frozenset({"testmod", "testfile", "run_docstring_examples", "DocTestRunner",
                     "DebugRunner", "DocTestSuite", "DocFileSuite"})


def _pytest_options() -> configparser.SectionProxy:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    return config["tool:pytest"]


def test_every_package_has_its_doctests_collected() -> None:
    options = _pytest_options()
    assert "--doctest-modules" in options["addopts"].split()
    assert sorted(set(PACKAGES) - set(options["testpaths"].split())) == []


def test_no_test_runs_doctests_by_hand() -> None:
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            name = node.attr if isinstance(node, ast.Attribute) else \
                node.id if isinstance(node, ast.Name) else None
            if name in BY_HAND:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert found == []


def test_every_registered_generator_shows_its_timetable() -> None:
    finder = doctest.DocTestFinder()
    without = []
    for name in schedule_names():
        generator = schedule_info(name).generator
        if not any(test.examples for test in finder.find(generator, generator.__name__)):
            without.append(f"{name} ({generator.__module__}.{generator.__name__})")
    assert without == []
