"""balance: exact against brute force (time, tie-break, memory, bandwidth), modes and errors."""

from __future__ import annotations

import math
import pickle
import random
import re
from collections.abc import Iterator
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balance_brute import best_top_two, cuts, stage_costs, top_two
from partitioners import (
    LayerCost,
    LossCost,
    MemoryLimitError,
    Profile,
    balance,
    held_microbatches,
    stage_memory,
    uniform,
)


def random_weights(rng: random.Random, layers: int) -> list[float]:
    kind = rng.choice(["int", "float", "mixed"])
    if kind == "int":
        return [rng.randint(0, 6) for _ in range(layers)]
    if kind == "float":
        scale = rng.choice([1.0, 1e-4, 1e3])
        return [rng.random() * scale for _ in range(layers)]
    return [rng.choice([0, 0.0, 1, 2.5, rng.random(), rng.randint(0, 3)]) for _ in range(layers)]


def random_cases(seed: int, count: int, most_layers: int
                 ) -> Iterator[tuple[random.Random, int, int]]:
    """``count`` cases of 1..``most_layers`` layers on 1..5 stages (at most one a layer), with
    the generator that drew them, for the case's own draws."""
    rng = random.Random(seed)
    for _ in range(count):
        layers = rng.randint(1, most_layers)
        yield rng, layers, rng.randint(1, min(5, layers))


def check_sizes(sizes: list[int], layers: int, stages: int) -> None:
    assert len(sizes) == stages
    assert all(size >= 1 for size in sizes)
    assert sum(sizes) == layers


def test_time_matches_brute_force_on_400_random_cases() -> None:
    for rng, layers, stages in random_cases(seed=2024, count=400, most_layers=12):
        weights = random_weights(rng, layers)
        sizes = balance(weights, stages, by="time")
        check_sizes(sizes, layers, stages)
        slowest, second = top_two(stage_costs(weights, sizes))
        best_slowest, best_second = best_top_two(weights, stages)
        assert math.isclose(slowest, best_slowest, rel_tol=1e-12, abs_tol=0)
        # Exact, not just close: costs are summed as fractions on both sides.
        assert (slowest, second) == (best_slowest, best_second), (weights, stages, sizes)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=20) | st.floats(min_value=0, max_value=1e3),
             min_size=1, max_size=10),
    st.integers(min_value=1, max_value=5),
)
def test_time_matches_brute_force_hypothesis(weights: list[float], stages: int) -> None:
    stages = min(stages, len(weights))
    sizes = balance(weights, stages)
    check_sizes(sizes, len(weights), stages)
    assert top_two(stage_costs(weights, sizes)) == best_top_two(weights, stages)


def test_tie_break_prefers_smallest_second_stage() -> None:
    # The bottleneck 10 is fixed; six ones then split 3 + 3, not 5 + 1 or 1 + 5.
    assert balance([10, 1, 1, 1, 1, 1, 1], 3) == [1, 3, 3]
    assert balance([1, 1, 1, 1, 1, 1, 10], 3) == [3, 3, 1]


def test_documented_examples() -> None:
    assert balance([3.0, 1.0, 2.0, 2.0], stages=2) == [2, 2]
    assert balance([0, 0, 0], 3) == [1, 1, 1]
    assert balance([5], 1) == [1]
    assert balance([7, 7, 7, 7], 4) == [1, 1, 1, 1]


def test_layer_costs_balance_forward_plus_backward() -> None:
    costs = [LayerCost(forward=f, backward=2 * f) for f in (1.0, 1.0, 4.0, 1.0, 1.0)]
    assert balance(costs, 3) == [2, 1, 2]
    assert balance([cost.time for cost in costs], 3) == [2, 1, 2]


def test_by_params_balances_parameter_bytes() -> None:
    costs = [LayerCost(1.0, 1.0, param_bytes=p) for p in (100, 100, 800, 100, 100, 100)]
    sizes = balance(costs, 3, by="params")
    assert sizes == [2, 1, 3]
    params = [cost.param_bytes for cost in costs]
    assert top_two(stage_costs(params, sizes)) == best_top_two(params, 3)


def test_uniform_gives_earlier_stages_the_remainder() -> None:
    assert uniform(10, 3) == [4, 3, 3]
    assert balance([1.0] * 10, 3, by="uniform") == [4, 3, 3]
    assert balance([100.0, 1.0, 1.0, 1.0], 2, by="uniform") == [2, 2]


def random_costs(rng: random.Random, layers: int) -> list[LayerCost]:
    return [
        LayerCost(
            forward=w,
            backward=0.0,
            param_bytes=rng.randint(0, 40),
            activation_bytes=rng.randint(0, 100),
            saved_bytes=rng.randint(0, 30),
        )
        for w in random_weights(rng, layers)
    ]


def memory_fits(costs: list[LayerCost], held: tuple[float, ...], limit: float):  # noqa: ANN201
    def allowed(sizes: list[int]) -> bool:
        return max(stage_memory(costs, sizes, held)) <= limit

    return allowed


def with_random_ties(rng: random.Random, costs: list[LayerCost]) -> list[LayerCost]:
    """Some later layers use part of an earlier layer's parameters (a head tied to the
    embedding), as ``profile`` reports them."""
    tied = []
    for layer, cost in enumerate(costs):
        origins = [o for o in range(layer) if costs[o].param_bytes and rng.random() < 0.3]
        ties = tuple((o, rng.randint(1, costs[o].param_bytes)) for o in origins)
        tied.append(LayerCost(cost.forward, cost.backward, param_bytes=cost.param_bytes,
                              activation_bytes=cost.activation_bytes,
                              saved_bytes=cost.saved_bytes, tied=ties))
    return tied


@pytest.mark.parametrize("ties", [False, True])
def test_memory_limit_matches_brute_force(ties: bool) -> None:
    checked = infeasible = 0
    for rng, layers, stages in random_cases(seed=7, count=300, most_layers=10):
        costs = random_costs(rng, layers)
        if ties:
            costs = with_random_ties(rng, costs)
        schedule = rng.choice(["1f1b", "gpipe"])
        microbatches = rng.randint(1, 6)
        limit = rng.randint(30, 400)
        held = held_microbatches(schedule, stages, microbatches)
        weights = [cost.time for cost in costs]
        allowed = memory_fits(costs, held, limit)
        expected = best_top_two(weights, stages, allowed=allowed)
        if expected is None:
            infeasible += 1
            smallest = min(max(stage_memory(costs, s, held)) for s in cuts(layers, stages))
            pattern = rf"smallest limit that fits is .*\b{math.ceil(smallest)}\b"
            with pytest.raises(ValueError, match=pattern):
                balance(costs, stages, memory_limit=limit, schedule=schedule,
                        microbatches=microbatches)
            continue
        sizes = balance(costs, stages, memory_limit=limit, schedule=schedule,
                        microbatches=microbatches)
        check_sizes(sizes, layers, stages)
        assert allowed(sizes)
        assert top_two(stage_costs(weights, sizes)) == expected
        checked += 1
    assert checked > 100 and infeasible > 20


def test_memory_error_names_the_smallest_limit_that_fits() -> None:
    costs = [LayerCost(1.0, 1.0, param_bytes=100, saved_bytes=10) for _ in range(4)]
    # 1F1B over 2 stages with 4 micro-batches holds 2 on stage 0 and 1 on stage 1.
    with pytest.raises(MemoryLimitError) as caught:
        balance(costs, 2, memory_limit=300, schedule="1f1b", microbatches=4)
    message = str(caught.value)
    assert "\n" not in message
    smallest = int(re.search(r"smallest limit that fits is (\d+) B", message).group(1))
    assert smallest == 2 * 200 + 2 * 20  # [2, 2]: stage 0 holds 2 micro-batches of 20 bytes
    assert caught.value.smallest_limit == smallest
    assert pickle.loads(pickle.dumps(caught.value)).smallest_limit == smallest
    assert balance(costs, 2, memory_limit=smallest, microbatches=4) == [2, 2]
    with pytest.raises(ValueError):
        balance(costs, 2, memory_limit=smallest - 1, microbatches=4)


def test_memory_limit_moves_layers_off_the_early_stages() -> None:
    # 1F1B: stage 0 of 2 holds two micro-batches, stage 1 one; time alone says [2, 2].
    costs = [LayerCost(1.0, 1.0, saved_bytes=10) for _ in range(4)]
    assert balance(costs, 2) == [2, 2]
    assert balance(costs, 2, memory_limit=30, microbatches=4) == [1, 3]
    assert balance(costs, 2, memory_limit=float("inf")) == [2, 2]


def test_bandwidth_matches_brute_force() -> None:
    for rng, layers, stages in random_cases(seed=11, count=300, most_layers=10):
        costs = random_costs(rng, layers)
        bandwidth = rng.choice([7, 10.0, 100, 0.5])
        limit = rng.choice([None, rng.randint(60, 400)])
        send = [Fraction(cost.activation_bytes) / Fraction(bandwidth) for cost in costs]
        weights = [cost.time for cost in costs]
        held = held_microbatches("1f1b", stages, None)
        allowed = None if limit is None else memory_fits(costs, held, limit)
        expected = best_top_two(weights, stages, send=send, allowed=allowed)
        if expected is None:
            with pytest.raises(ValueError):
                balance(costs, stages, memory_limit=limit, bandwidth=bandwidth)
            continue
        sizes = balance(costs, stages, memory_limit=limit, bandwidth=bandwidth)
        check_sizes(sizes, layers, stages)
        assert top_two(stage_costs(weights, sizes, send)) == expected, (costs, stages, bandwidth)


def test_bandwidth_prefers_cutting_at_small_activations() -> None:
    costs = [LayerCost(1.0, 0.0, activation_bytes=size) for size in (1, 100, 100, 100)]
    assert balance(costs, 2) == [2, 2]
    # Cutting after layer 1 sends 100 bytes (2 s at 50 B/s): stage 0 would take 4 s.
    # Cutting after layer 0 sends 1 byte: stages take 1.02 s and 3 s.
    assert balance(costs, 2, bandwidth=50.0) == [1, 3]


def test_last_stage_extra_matches_brute_force() -> None:
    moved = 0
    for rng, layers, stages in random_cases(seed=19, count=300, most_layers=10):
        costs = random_costs(rng, layers)
        extra = rng.choice([0, 1, 2.5, rng.random() * 4, 7])
        bandwidth = rng.choice([None, 10.0])
        limit = rng.choice([None, rng.randint(60, 400)])
        weights = [cost.time for cost in costs]
        send = None
        if bandwidth is not None:
            send = [Fraction(cost.activation_bytes) / Fraction(bandwidth) for cost in costs]
        held = held_microbatches("1f1b", stages, None)
        allowed = None if limit is None else memory_fits(costs, held, limit)
        expected = best_top_two(weights, stages, send=send, allowed=allowed, last_extra=extra)
        options = {"memory_limit": limit, "bandwidth": bandwidth, "last_stage_extra": extra}
        if expected is None:
            with pytest.raises(ValueError):
                balance(costs, stages, **options)
            continue
        sizes = balance(costs, stages, **options)
        check_sizes(sizes, layers, stages)
        assert top_two(stage_costs(weights, sizes, send, extra)) == expected, (costs, extra)
        moved += sizes != balance(costs, stages, memory_limit=limit, bandwidth=bandwidth)
        # Plain weights take it too.
        if bandwidth is None and limit is None:
            plain = balance(weights, stages, last_stage_extra=extra)
            assert top_two(stage_costs(weights, plain, None, extra)) == expected
    assert moved > 20  # the extra changes the cut often enough to be tested


def test_a_profiles_loss_is_charged_to_the_last_stage() -> None:
    # Four equal layers; the loss costs two layers' time: time alone says [2, 2].
    layers = [LayerCost(1.0, 2.0, param_bytes=100, name="Linear") for _ in range(4)]
    assert balance(layers, 2) == [2, 2]
    measured = Profile(layers, loss=LossCost(forward=2.0, backward=4.0))
    assert balance(measured, 2) == [3, 1]
    assert balance(measured, 2, last_stage_extra=0) == [2, 2]  # 0 turns it off
    assert balance(layers, 2, last_stage_extra=6.0) == [3, 1]
    assert balance(measured, 2, by="params") == [2, 2]  # bytes: the loss time is no weight
    assert balance(measured, 2, by="uniform") == [2, 2]


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"last_stage_extra": -1.0}, r"last_stage_extra must be finite seconds >= 0, got -1.0"),
        ({"last_stage_extra": float("inf")}, r"last_stage_extra must be finite"),
        ({"last_stage_extra": "1"}, r"last_stage_extra must be finite seconds >= 0, got '1'"),
        ({"last_stage_extra": 1.0, "by": "params"}, r"needs by='time', got by='params'"),
    ],
)
def test_bad_last_stage_extra(options: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        balance([LayerCost(1.0, 1.0), LayerCost(1.0, 1.0)], 2, **options)


@pytest.mark.parametrize(
    ("costs", "stages", "pattern"),
    [
        ([1.0, 2.0], 3, r"cannot cut 2 layers into 3 non-empty stages: expected stages <= 2"),
        ([1.0, 2.0], 0, r"stages must be >= 1, got stages=0"),
        ([1.0, 2.0], -1, r"stages must be >= 1"),
        ([1.0, 2.0], 1.5, r"stages must be an int >= 1, got 1.5"),
        ([1.0, 2.0], True, r"stages must be an int"),
        ([], 1, r"expected at least one layer"),
        ([1.0, -2.0], 1, r"cost 1: expected a finite weight >= 0, got -2.0"),
        ([1.0, float("nan")], 1, r"expected a finite weight"),
        (["a"], 1, r"cost 0: expected a number or a LayerCost, got 'a'"),
        ([LayerCost(1.0, 1.0), 2.0], 1, r"all LayerCost or all plain numbers"),
    ],
)
def test_bad_input_raises_value_error(costs: list, stages: object, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        balance(costs, stages)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"by": "speed"}, r"by must be one of time, params, uniform; got 'speed'"),
        ({"by": "params"}, r"by='params' needs LayerCost entries"),
        ({"memory_limit": 10}, r"memory_limit needs LayerCost entries"),
        ({"bandwidth": 10}, r"bandwidth needs LayerCost entries"),
    ],
)
def test_options_that_need_layer_costs(options: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        balance([1.0, 2.0], 1, **options)


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"bandwidth": 0}, r"bandwidth must be bytes per second > 0, got 0"),
        ({"bandwidth": 1.0, "by": "params"}, r"needs by='time', got by='params'"),
        ({"memory_limit": -1}, r"memory_limit must be a number of bytes >= 0, got -1"),
        ({"memory_limit": 10, "schedule": "nope"}, r"unknown schedule 'nope'"),
        ({"memory_limit": 1, "by": "uniform"}, r"the uniform cut \[1, 1\] needs"),
    ],
)
def test_bad_options_raise_value_error(options: dict, pattern: str) -> None:
    costs = [LayerCost(1.0, 1.0, param_bytes=8), LayerCost(1.0, 1.0, param_bytes=8)]
    with pytest.raises(ValueError, match=pattern):
        balance(costs, 2, **options)


@pytest.mark.parametrize(("tied", "pattern"), [
    (((2, 10),), r"LayerCost.tied of layer 1: expected an earlier layer, got layer 2"),
    (((1, 10),), r"expected an earlier layer, got layer 1"),
    (((0, 61),), r"61 bytes of layer 0, which has only 60 parameter bytes"),
])
def test_ties_that_cannot_be_are_named(tied: tuple, pattern: str) -> None:
    costs = [LayerCost(1.0, 1.0, param_bytes=60), LayerCost(1.0, 1.0, tied=tied),
             LayerCost(1.0, 1.0, param_bytes=5)]
    with pytest.raises(ValueError, match=pattern):
        balance(costs, 2, memory_limit=1000, schedule="1f1b", microbatches=2)
    with pytest.raises(ValueError, match=pattern):
        stage_memory(costs, [1, 2], (2.0, 1.0))
    from partitioners.plan.costs import chunk_sums

    with pytest.raises(ValueError, match=pattern):
        chunk_sums(costs, [1, 2])
