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
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent

# Names whose use means another process: the spawn harness, subprocesses, notebook kernels.
PROCESS_NAMES = frozenset({"run_ranks", "run_ranks_raw", "subprocess", "nbclient"})

# Single-process tests that took 4 s or more (all their cases) on 2 loaded cores: sweeps,
# fuzzing, torch.compile, real Hugging Face models. By file and test name, so that they
# survive a move to another folder. Remeasure with
#   pytest -m "not slow" -p no:randomly --durations=0
MEASURED = frozenset({
    "test_traced_exact.py::test_more_families_as_written",  # 8-12 s a case (a trace each)
    "test_plan.py::test_the_pick_is_the_fastest_that_fits",  # 47 s
    "test_comm.py::test_every_registered_schedule_gets_a_plan_that_validates",  # 26-53 s
    "test_plan.py::test_an_impossible_limit_names_the_smallest_that_fits",  # 18 s
    # about 10 s a case when they pass (a traced GPT-2 and Llama, 20 cases)
    "test_traced_exact.py::test_loss_and_gradients_equal_the_plain_model",
    "test_traced_exact.py::test_the_default_cut_is_prologue_blocks_epilogue",  # 4-10 s
    "test_traced_exact.py::test_dropout_gives_one_result_across_schedules_cuts_and_modes",
    "test_trace_sizes.py::test_one_row_micro_batches_of_a_mixture_of_experts_run_exactly",
    "test_default_cut.py::test_a_resnet_is_cut_at_every_basic_block_and_is_exact",  # 20-33 s
    "test_traced_planning.py::test_time_balance_measured_memory_and_predict",  # 4 s
    "test_traced_checkpoints.py::test_a_pipeline_checkpoint_loads_into_the_plain_model_and_back",
    "test_traced_errors.py::test_a_none_argument_is_a_constant_of_the_graph",  # 7 s
    "test_traced_exact.py::test_sequence_length_changes_between_steps",  # 6 s
    # a trace and three split schedules each: 3-20 s
    "test_traced_exact.py::test_traced_linear_layers_defer_their_weight_gradients_to_w_exactly",
    "test_v_shape.py::test_peak_activations_within_the_bar",  # 9 s
    "test_v_shape.py::test_no_schedule_idles_less_than_the_bound",  # 3-12 s
    "test_v_shape.py::test_bubble_time_bars_of_issue_13",  # 6-15 s
    "test_wire.py::test_random_headers_decode_within_the_limit_or_are_refused",  # 7 s
    "test_split_exact.py::test_compiled_blocks_stay_exact_under_split_schedules",  # 6 s
    "test_cli.py::test_auto_plans_for_sharded_replicas",  # 6 s
    "test_trace_regions.py::test_t5_with_its_default_config_is_exact",  # 15-40 s: T5's traces
    "test_traced_planning.py::test_the_command_and_the_pipe_cut_and_price_one_way",  # 10 s
    "test_close_undoes.py::test_after_close_no_module_has_an_attribute_it_did_not_have",  # 5-15 s
})


def pytest_configure(config: pytest.Config) -> None:
    # Registered in setup.cfg too; here as well so that a run from another ini still knows it.
    config.addinivalue_line("markers", "slow: starts processes or runs long; "
                                       "pytest -m 'not slow' is the quick tier")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen: dict[int, bool] = {}
    matched: set[str] = set()
    for item in items:
        key = f"{Path(str(item.fspath)).name}::{getattr(item, 'originalname', item.name)}"
        measured = key in MEASURED
        if measured:
            matched.add(key)
        if measured or any(_starts_processes(function, seen) for function in _functions_of(item)):
            item.add_marker(pytest.mark.slow)
    # A renamed test or file would leave the quick tier silently: say so on a full run.
    if config.args_source is pytest.Config.ArgsSource.TESTPATHS and MEASURED - matched:
        warnings.warn(pytest.PytestConfigWarning(
            f"tests/conftest.py MEASURED names tests that were not collected: "
            f"{sorted(MEASURED - matched)}"), stacklevel=1)


def _functions_of(item: pytest.Item) -> Iterator[Callable[..., Any]]:
    """The test function and the functions of the fixtures it uses: by argument, or by a
    name in its code or its parameters (``request.getfixturevalue(name)``)."""
    function = getattr(item, "function", None)
    if function is None:  # a doctest: it runs in this process
        return
    yield function
    info = getattr(item, "_fixtureinfo", None)
    for definitions in getattr(info, "name2fixturedefs", {}).values():
        for definition in definitions:
            yield definition.func
    callspec = getattr(item, "callspec", None)
    code = getattr(inspect.unwrap(function), "__code__", None)
    named = {value for value in (callspec.params.values() if callspec is not None else ())
             if isinstance(value, str)}
    named.update(_strings(code) if code is not None else ())
    manager = item.session._fixturemanager
    for name in named:
        if name.isidentifier():
            for definition in manager.getfixturedefs(name, item) or ():
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


def _strings(code: types.CodeType) -> Iterator[str]:
    for constant in code.co_consts:
        if isinstance(constant, str):
            yield constant
        elif isinstance(constant, types.CodeType):
            yield from _strings(constant)


def _is_test_code(code: types.CodeType) -> bool:
    return Path(code.co_filename).resolve().is_relative_to(TESTS)
