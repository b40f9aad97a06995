"""Payloads cross ranks without pickle (pipeline.payloads.tree): what may travel, exactly, and what a
peer's bytes can make a rank do (raise a StructureError, nothing else)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import sys
import time
from collections import OrderedDict
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from dist_harness import run_ranks
from hostile import Evil, hostile_pickles
from pipeline import Pipe
from pipeline.payloads.checked_json import MAX_DEPTH, StructureError
from pipeline.payloads.structure import MAX_STRUCTURE_BYTES, decode_structure
from pipeline.payloads.tree import STRUCTURED, from_wire, to_wire

TOLERANCE = 1e-10
SCHEDULES = ("1f1b", "zb-h1")


class Pair(NamedTuple):
    hidden: torch.Tensor
    gate: torch.Tensor
    scale: int


@dataclasses.dataclass
class Carry:
    hidden: torch.Tensor
    mask: torch.Tensor
    note: str
    extra: Any = None


pytree.register_dataclass(Carry)


@dataclasses.dataclass
class Loose:  # never registered: refused at the sender
    hidden: torch.Tensor


class Box:
    """A class registered with a context that is not plain data: refused at the sender."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


pytree.register_pytree_node(Box, lambda box: ([box.value], len),
                            lambda values, _: Box(*values))



def _same(a: Any, b: Any) -> bool:
    """Equal values of exactly the same types, all the way down (NaN is NaN, -0.0 is not 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, complex):
        return _same(a.real, b.real) and _same(a.imag, b.imag)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return bool(a == b)


def _round_trip(payload: Any) -> Any:
    kind, tensors = to_wire(payload)
    return from_wire(kind, tuple(tensors))


@pytest.mark.parametrize("payload", [
    {"hidden": [torch.randn(2, 3), None], "rows": 2, "mask": torch.ones(2, dtype=torch.bool)},
    (torch.randn(1), None, True, False, 0, -7, 2**200, 1.5, -0.0, float("nan"), float("inf"),
     1 - 2j, "text", "ünïcode \u2603"),
    Pair(torch.randn(3, dtype=torch.float64), torch.arange(3), 4),
    Pair(torch.randn(1), torch.randn(1), 2)._replace(scale=-1),
    [Pair(torch.randn(1), torch.randn(1), 0), {"inner": (Pair(torch.ones(1), torch.ones(1), 1),)}],
    Carry(torch.randn(2), torch.ones(2, dtype=torch.bool), "note", extra=None),
    {"carry": Carry(torch.randn(2), torch.zeros(2, dtype=torch.bool), "n", extra=(1, "two"))},
    OrderedDict([("b", torch.ones(1)), ("a", 3)]),
    {0: torch.ones(1), "zero": 0},
    torch.max(torch.randn(2, 3), dim=1),
    (torch.randn(2, dtype=torch.complex128), ()),
    (),
    7,
    None,
])
def test_allowed_leaves_namedtuples_and_registered_dataclasses_round_trip_exactly(
        payload: Any) -> None:
    assert _same(_round_trip(payload), payload)


def test_a_namedtuple_of_tensors_is_not_sent_as_a_plain_tuple() -> None:
    pair = Pair(torch.ones(1), torch.zeros(1), 3)._replace(scale=torch.ones(1))
    back = _round_trip(pair)
    assert type(back) is Pair and torch.equal(back.scale, torch.ones(1))
    assert type(_round_trip((torch.ones(1), torch.zeros(1)))) is tuple


def test_a_leaf_whose_reduce_would_create_a_file_is_refused_at_the_sender(tmp_path: Path) -> None:
    target = tmp_path / "created"
    with pytest.raises(TypeError, match=r"output\[1\]\['mask'\] is a hostile\.Evil, "
                                        r"which cannot cross.*register_pytree_node"):
        to_wire((torch.ones(1), {"mask": Evil(target), "rows": 2}))
    assert not target.exists()


@pytest.mark.parametrize(("payload", "message"), [
    ([torch.ones(1), np.ones(2)], r"output\[1\] is a numpy\.ndarray.*Convert it to a tensor"),
    ({"scale": np.float64(2.0)}, r"output\['scale'\] is a numpy\.float64"),
    ((torch.ones(1), print), r"output\[1\] is a builtin_function_or_method"),
    ((torch.ones(1), os), r"output\[1\] is a module"),
    ((nn.Linear(1, 1),), r"output\[0\] is a torch\.nn\.modules\.linear\.Linear"),
    ({"x": Loose(torch.ones(1))}, r"output\['x'\] is a test_payload_trust\.Loose.*"
                                  r"register_dataclass\(Loose\) on every rank"),
    (Pair(torch.ones(1), torch.ones(1), object()), r"output\.scale is a object"),
    (Carry(torch.ones(1), torch.ones(1), "n", extra=object()), r"output\.extra is a object"),
    ({(1, 2): torch.ones(1)}, r"dict keys crossing ranks must be str or int.*\(1, 2\)"),
    ([Box(torch.ones(1))], r"the context of output\[0\] is a builtin_function_or_method.*"
                           r"test_payload_trust\.Box is registered as a pytree node, and its "
                           r"context must then be plain data"),
])
def test_other_leaves_are_refused_at_the_sender_naming_type_and_path(
        payload: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        to_wire(payload)


def test_a_namedtuple_class_the_receiver_could_not_find_is_refused_at_the_sender() -> None:
    class Local(NamedTuple):
        value: torch.Tensor

    with pytest.raises(TypeError, match=r"output\[0\] is a .*Local, whose class cannot be found.*"
                                        r"define the class at module level"):
        to_wire([Local(torch.ones(1))])


def test_a_structure_too_deep_or_too_large_is_refused_at_the_sender() -> None:
    deep: Any = torch.ones(1)
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(ValueError, match=f"at most {MAX_DEPTH} containers"):
        to_wire(deep)
    with pytest.raises(ValueError, match=f"at most {MAX_STRUCTURE_BYTES} bytes"):
        to_wire((torch.ones(1), "x" * MAX_STRUCTURE_BYTES))


def _blob(data: bytes | str) -> torch.Tensor:
    raw = data.encode() if isinstance(data, str) else data
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def test_a_pickle_that_would_create_a_file_is_rejected_by_the_receiver(tmp_path: Path) -> None:
    target, pickles = hostile_pickles(tmp_path, lambda evil: {"tree": evil})
    for pickled in pickles:
        with pytest.raises(StructureError, match="expected a structure in JSON"):
            from_wire(STRUCTURED, (torch.ones(1), _blob(pickled)))
    assert not target.exists()  # the gadget creates a file where pickle is trusted: here, none


def _structure(tree: Any = None, leaves: Any = (1,), **fields: Any) -> str:
    return json.dumps({"format": 1, "tree": tree, "leaves": list(leaves), **fields})


MALFORMED = [
    ("{", "expected a structure in JSON"),
    ('"just a string"', "expected an object with keys format, tree and leaves"),
    (_structure(extra=1), "expected an object with keys format, tree and leaves"),
    ('{"format":1,"format":1,"tree":null,"leaves":[1]}', "expected distinct keys"),
    (_structure().replace('"format": 1', '"format": 2'), "expected format 1, got 2"),
    (_structure().replace('"format": 1', '"format": true'), "expected format 1, got True"),
    (_structure(leaves=[1.5]), "expected floats as tagged float.hex"),
    (_structure(leaves=[]).replace("[]", "[NaN]"), "expected floats as tagged float.hex"),
    (_structure(leaves=[{"float": "0x1p+9999999999999999999999999999999"}]), "float.hex"),
    (_structure(leaves=[{"float": "0x1p+99999"}]), "float.hex.*too large"),
    (_structure(leaves=[int("9" * 100)]), "an int of at most 256 bits"),
    (_structure(leaves=[int("9" * 80)]), "an int of at most 256 bits"),
    (_structure(leaves=[{"tensor": 1}]), "expected tensor 0 of the 1"),
    (_structure(leaves=[{"tensor": 0}, {"tensor": 0}]), "expected tensor 1 of the 1"),
    (_structure(leaves=[2]), "to place the 1 tensors that came with it, got 0"),
    (_structure(leaves=[{"tensor": 0}, 2]), "a place for each of the 2 leaves, got 1 left over"),
    (_structure({"node": "tuple", "children": [None, None]}, [{"tensor": 0}]),
     "as many leaves as the tree has places"),
    (_structure({"node": "set", "children": []}, [{"tensor": 0}]), "expected a node kind among"),
    (_structure({"node": "tuple", "children": [], "class": "x:y"}, [{"tensor": 0}]),
     "expected a tuple node with the fields"),
    (_structure({"node": "dict", "keys": ["a", "a"], "children": [None, None]},
                [{"tensor": 0}, 1]), "expected 2 distinct str or int keys"),
    (_structure({"node": "dict", "keys": [[1]], "children": [None]}, [{"tensor": 0}]),
     "expected 1 distinct str or int keys"),
    (_structure([None] * 3, [{"tensor": 0}]), "expected a tree node"),
    (_structure(leaves=[{"tensor": 0}, {"set": [1]}]), "expected a value tagged float"),
    (_structure(leaves=[{"tensor": 0}, {"dict": [["k", 1], ["k", 2]]}]), "distinct dict keys"),
    (_structure(leaves=[{"tensor": 0}, {"float": 1, "list": []}]), "expected a value"),
    ("[" * 100_000 + "]" * 100_000, "expected a structure in JSON"),
    (_structure({"node": "namedtuple", "class": "builtins:dict", "children": []},
                [{"tensor": 0}]), "expected a namedtuple class, got 'builtins:dict'"),
    (_structure({"node": "namedtuple", "class": "test_payload_trust:Pair", "children": [None]},
                [{"tensor": 0}]), "expected 3 fields for test_payload_trust:Pair, got 1"),
    (_structure({"node": "namedtuple", "class": "os:system", "children": []}, [{"tensor": 0}]),
     "expected the name of a class in a module already imported"),
    (_structure({"node": "registered", "class": "antigravity:Anything", "context": None,
                 "children": []}, [{"tensor": 0}]), "nothing is imported on a peer's word"),
    (_structure({"node": "registered", "class": "pathlib:Path", "context": None,
                 "children": [None]}, [{"tensor": 0}]),
     "expected a class registered as a pytree node on this rank, got 'pathlib:Path'"),
    (_structure({"node": "registered", "class": "collections:defaultdict", "context": None,
                 "children": []}, [{"tensor": 0}]), "registered as a pytree node"),
    (_structure({"node": "registered", "class": "test_payload_trust:Carry",
                 "context": {"list": [{"list": ["__class__"]}, {"list": []}]},
                 "children": [None]}, [{"tensor": 0}]),
     "could not rebuild test_payload_trust:Carry"),
]


@pytest.mark.parametrize(("text", "message"), MALFORMED)
def test_malformed_structures_raise_a_clear_error_and_import_nothing(
        text: str, message: str) -> None:
    with pytest.raises(StructureError, match=message):
        from_wire(STRUCTURED, (torch.ones(1), _blob(text)))
    assert "antigravity" not in sys.modules


def test_a_structure_blob_of_the_wrong_size_or_type_is_rejected() -> None:
    with pytest.raises(StructureError, match=f"at most {MAX_STRUCTURE_BYTES}"):
        from_wire(STRUCTURED, (torch.zeros(MAX_STRUCTURE_BYTES + 1, dtype=torch.uint8),))
    with pytest.raises(StructureError, match="uint8 bytes in one dimension"):
        from_wire(STRUCTURED, (torch.zeros(4, dtype=torch.int32),))
    with pytest.raises(StructureError, match="got kind 7 with 1"):
        from_wire(7, (torch.zeros(1),))
    with pytest.raises(StructureError, match=f"at most {MAX_STRUCTURE_BYTES} bytes"):
        decode_structure(b" " * (MAX_STRUCTURE_BYTES + 1), ())


# Between stages: models whose stage 0 returns a namedtuple, a registered dataclass, or an
# unregistered one (balance [2, 2]: the container crosses from the first stage to the second).

class ToPair(nn.Module):
    def forward(self, h: torch.Tensor) -> Pair:
        return Pair(h, torch.tanh(h), 3)


class FromPair(nn.Module):
    def forward(self, value: Pair) -> torch.Tensor:
        if type(value) is not Pair:
            raise TypeError(f"expected a Pair, got {type(value).__name__}")
        return value.hidden * value.gate * value.scale


class ToCarry(nn.Module):
    def forward(self, h: torch.Tensor) -> Carry:
        return Carry(h, h > 0, "positive", extra={"scale": 2})


class FromCarry(nn.Module):
    def forward(self, value: Carry) -> torch.Tensor:
        if type(value) is not Carry or value.note != "positive":
            raise TypeError(f"expected a Carry, got {value!r}")
        return value.hidden * value.mask * value.extra["scale"]


class ToLoose(nn.Module):
    def forward(self, h: torch.Tensor) -> Loose:
        return Loose(h)


class FromLoose(nn.Module):
    def forward(self, value: Loose) -> torch.Tensor:
        return value.hidden


PAIRS = {"namedtuple": (ToPair, FromPair), "dataclass": (ToCarry, FromCarry),
         "unregistered": (ToLoose, FromLoose)}


def _model(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    to, back = PAIRS[kind]
    return nn.Sequential(nn.Linear(6, 8), to(), back(), nn.Linear(8, 2)).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(8, 6, dtype=torch.float64, generator=generator),
            torch.randn(8, 2, dtype=torch.float64, generator=generator))


def _grad_error(model: nn.Module, reference: nn.Module) -> tuple[float, int]:
    """The largest gradient difference over the parameters this process holds, and their count."""
    worst, compared = 0.0, 0
    for parameter, expected in zip(model.parameters(), reference.parameters()):
        if parameter.grad is not None:
            worst = max(worst, (parameter.grad - expected.grad).abs().max().item())
            compared += 1
    return worst, compared


def _step(kind: str, schedule: str, rank: int | None) -> tuple[float, int]:
    model = _model(kind)
    reference = copy.deepcopy(model)
    x, y = _batch()
    nn.MSELoss()(reference(x), y).backward()
    if rank is None:
        pipe = Pipe(model, 4, balance=[2, 2], devices=["cpu", "cpu"], schedule=schedule,
                    loss_fn=nn.MSELoss(), timeout=10)
        pipe.step(x, y)
    else:
        pipe = Pipe(model, 4, balance=[2, 2], schedule=schedule, loss_fn=nn.MSELoss(),
                    group=dist.group.WORLD, timeout=10)
        pipe.step(x if rank == 0 else None, y if rank == 1 else None)
    pipe.close()
    return _grad_error(model, reference)


def on_ranks(rank: int, world: int) -> dict[str, Any]:
    """Every container x schedule on two gloo ranks, then the unregistered dataclass."""
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for kind in ("namedtuple", "dataclass"):
        for schedule in SCHEDULES:
            results[f"{kind} {schedule}"] = _step(kind, schedule, rank)
    x, y = _batch()
    group = dist.new_group(list(range(world)))  # a failed step makes its group unusable
    pipe = Pipe(_model("unregistered"), 4, balance=[2, 2], schedule="1f1b",
                loss_fn=nn.MSELoss(), group=group, timeout=10)
    start = time.monotonic()
    try:
        pipe.step(x if rank == 0 else None, y if rank == 1 else None)
        results["refused"] = (None, "", time.monotonic() - start)
    except Exception as error:  # noqa: BLE001 - reported to the test
        results["refused"] = (type(error).__name__, str(error), time.monotonic() - start)
    pipe.close()
    return results


@cache
def rank_results() -> list[dict[str, Any]]:
    return run_ranks(on_ranks, 2, timeout=120.0)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", ["namedtuple", "dataclass"])
def test_a_namedtuple_or_registered_dataclass_between_ranks_gets_exact_gradients(
        kind: str, schedule: str) -> None:
    counts = []
    for results in rank_results():
        error, compared = results[f"{kind} {schedule}"]
        assert error < TOLERANCE
        counts.append(compared)
    assert counts == [2, 2]  # each rank holds one Linear: weight and bias


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", ["namedtuple", "dataclass"])
def test_a_namedtuple_or_registered_dataclass_between_stages_in_one_process(
        kind: str, schedule: str) -> None:
    error, compared = _step(kind, schedule, None)
    assert error < TOLERANCE and compared == 4


def test_an_unregistered_dataclass_is_refused_with_the_advice_on_every_rank() -> None:
    sender, receiver = (results["refused"] for results in rank_results())
    assert sender[0] == "TypeError" and receiver[0] == "PeerError"
    for _, message, seconds in (sender, receiver):
        assert "output is a test_payload_trust.Loose" in message
        assert "register_dataclass(Loose) on every rank" in message
        assert seconds < 10  # the Pipe's timeout: refused, not waited out


@dataclasses.dataclass
class _Opaque:
    hidden: torch.Tensor


class _MakesOpaque(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> _Opaque:
        return _Opaque(self.linear(x))


class _TakesOpaque(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, box: _Opaque) -> torch.Tensor:
        return self.linear(box.hidden)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_an_unregistered_dataclass_is_refused_in_one_process_too(schedule: str) -> None:
    """One process passes objects as they are, but autograd cannot see into an unregistered
    dataclass: its tensors would get no gradient (every checkpoint mode wrong), so it is
    refused with the same advice."""
    pipe = Pipe(nn.Sequential(_MakesOpaque(), _TakesOpaque()), 2, balance=[1, 1],
                devices=["cpu", "cpu"], schedule=schedule, loss_fn=nn.MSELoss())
    with pytest.raises(TypeError, match="_Opaque, which is not a pytree node.*register_dataclass"):
        pipe.step(torch.randn(4, 4), torch.randn(4, 4))
