"""Nothing a peer sends is unpickled (pipeline.group.collectives): no pickle loader anywhere under
pipeline/, shared values round-trip exactly, hostile bytes raise a clear error, and a value
that may not cross is refused at its sender on every rank. Checkpoints use none of
torch.distributed.checkpoint's entry points that unpickle a file or a peer's bytes (their
crafted files are tested in test_checkpoint_trust)."""

from __future__ import annotations

import ast
import math
import time
import types
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dist_harness import run_ranks
from hostile import Evil, hostile_pickles
from partitioners import LayerCost
from partitioners.plan.search import Candidate, Plan, plan
from partitioners.plan.costs import linear_costs
from pipeline.group.collectives import broadcast_object, gather_objects
from pipeline.payloads.checked_json import MAX_DEPTH, StructureError
from pipeline.payloads.values import DTYPES, MAX_JSON_BYTES, crosses, decode, encode
from pipeline.predict.fixed_bytes import FixedBytes
from pipeline.predict.probe import ChunkCosts
from pipeline.transports.groups import pipeline_groups
from schedules import Action, Op, get_schedule

PIPELINE = Path(__file__).resolve().parents[3] / "pipeline"
PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill"}
OBJECT_COLLECTIVES = {"all_gather_object", "gather_object", "broadcast_object_list",
                      "scatter_object_list"}


# -- no loader of pickles in the library --------------------------------------------------------


def _forbidden(source: str) -> list[str]:
    """``line: what`` for each way ``source`` could unpickle bytes."""
    tree = ast.parse(source)
    aliases = {alias.asname or alias.name for node in ast.walk(tree)
               if isinstance(node, ast.Import) for alias in node.names
               if alias.name in PICKLE_MODULES}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (node.module in PICKLE_MODULES and alias.name in ("load", "loads", "Unpickler")
                        or alias.name in OBJECT_COLLECTIVES):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute):
            base = node.value.id if isinstance(node.value, ast.Name) else None
            if (node.attr in ("load", "loads") and base in aliases
                    or node.attr == "Unpickler" or node.attr in OBJECT_COLLECTIVES):
                found.append(f"{node.lineno}: {base}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id == "Unpickler":
            found.append(f"{node.lineno}: Unpickler")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "load" and isinstance(node.func.value, ast.Name)
              and node.func.value.id == "torch"
              and not any(k.arg == "weights_only" and isinstance(k.value, ast.Constant)
                          and k.value.value is True for k in node.keywords)):
            found.append(f"{node.lineno}: torch.load without weights_only=True")
    return found


def test_the_checker_finds_every_way_to_unpickle() -> None:
    source = """
import pickle as p
import torch
import torch.distributed as dist
from pickle import loads
from torch.distributed import all_gather_object
p.loads(b""); p.load(f); p.Unpickler(f); Unpickler
dist.all_gather_object(rows, x); dist.gather_object(x); dist.broadcast_object_list(rows)
torch.distributed.scatter_object_list(rows, x)
torch.load(path); torch.load(path, weights_only=False)
torch.load(path, weights_only=True); json.loads(text)
"""
    found = _forbidden(source)
    assert len(found) == 12, found
    assert not any(line.startswith("12:") for line in found)  # weights_only=True, json.loads


def test_nothing_under_pipeline_unpickles_or_gathers_objects_with_pickle() -> None:
    sources = sorted(PIPELINE.rglob("*.py"))
    assert len(sources) > 20
    found = [f"{path.relative_to(PIPELINE.parent)}:{line}" for path in sources
             for line in _forbidden(path.read_text(encoding="utf-8"))]
    assert not found, found


# -- checkpoints: no DCP entry point that unpickles, gathers objects or steps the optimizer -------

# FileSystemReader.read_metadata unpickles .metadata; dcp.save/load (state_dict_saver/loader)
# coordinate ranks with object collectives; get/set_state_dict run optimizer.step() on a fresh
# optimizer; DefaultLoadPlanner.load_bytes reads bytes entries with torch.load(weights_only=False).
DCP_FORBIDDEN = {"read_metadata", "state_dict_loader", "state_dict_saver", "get_state_dict",
                 "set_state_dict", "get_optimizer_state_dict", "set_optimizer_state_dict",
                 "_init_optim_state", "_load_state_dict_from_keys", "_save_state_dict",
                 "_load_state_dict", "async_save"}
DCP_MODULE = "torch.distributed.checkpoint"


def _dcp_forbidden(source: str) -> list[str]:
    """``line: what`` for each use of a DCP entry point that unpickles, gathers objects or
    steps a live optimizer, and each load planner that keeps DefaultLoadPlanner's load_bytes."""
    tree = ast.parse(source)
    modules = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names if alias.name == DCP_MODULE and alias.asname}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name in DCP_FORBIDDEN or (
                        node.module == DCP_MODULE and alias.name in ("save", "load")):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
            if node.module and node.module.rsplit(".", 1)[-1] in DCP_FORBIDDEN:
                found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Attribute):
            base = node.value.id if isinstance(node.value, ast.Name) else None
            if node.attr in DCP_FORBIDDEN or (base in modules and node.attr in ("save", "load")):
                found.append(f"{node.lineno}: {base}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in DCP_FORBIDDEN:
            found.append(f"{node.lineno}: {node.id}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "DefaultLoadPlanner"):
            found.append(f"{node.lineno}: DefaultLoadPlanner() reads bytes with weights_only=False")
        elif isinstance(node, ast.ClassDef) and any(
                isinstance(base, ast.Name) and base.id == "DefaultLoadPlanner"
                for base in node.bases):
            overrides = [item for item in node.body
                         if isinstance(item, ast.FunctionDef) and item.name == "load_bytes"]
            if not overrides or "weights_only=True" not in ast.unparse(overrides[0]):
                found.append(f"{node.lineno}: {node.name} keeps load_bytes without "
                             f"weights_only=True")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def test_the_checkpoint_checker_finds_every_unsafe_dcp_entry_point() -> None:
    source = """
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import load, FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as loading
dcp.save(state, checkpoint_id=path); dcp.load(state, checkpoint_id=path)
FileSystemReader(path).read_metadata(); _init_optim_state(optimizer)
planner = DefaultLoadPlanner()
class Planner(DefaultLoadPlanner):
    pass
class Checked(DefaultLoadPlanner):
    def load_bytes(self, item, value):
        self.state_dict[item.dest_index.fqn] = torch.load(value, weights_only=True)
dcp.FileSystemWriter(path); get_model_state_dict(model); Checked()
"""
    found = _dcp_forbidden(source)
    assert [line.split(":")[0] for line in found] == [
        "3", "4", "4", "5", "6", "6", "7", "7", "8", "9"], found


def test_nothing_under_pipeline_uses_a_dcp_entry_point_that_unpickles_or_steps() -> None:
    sources = sorted(PIPELINE.rglob("*.py"))
    found = [f"{path.relative_to(PIPELINE.parent)}:{line}" for path in sources
             for line in _dcp_forbidden(path.read_text(encoding="utf-8"))]
    assert not found, found
    assert any("DefaultLoadPlanner" in path.read_text(encoding="utf-8") for path in sources)


# -- round trips ---------------------------------------------------------------------------------


def _plan() -> Plan:
    layers = [LayerCost(forward=1.0 + i / 7, backward=2.0 + i / 3, saved_bytes=10 + i,
                        activation_bytes=4, param_bytes=8) for i in range(6)]
    return plan(linear_costs(layers, rows=1), 2, 8, memory_limit=1e9,
                schedules=["1f1b", "interleaved-1f1b", "zb-v"], prune=False)


def _instances() -> dict[str, Any]:
    """A real instance of every class that may cross."""
    chosen = _plan()
    timeline = chosen.predicted
    return {
        "Action": Action(Op.I, 3, 1),
        "Op": Op.W,
        "Schedule": get_schedule("zb-v", 2, 4),
        "Event": timeline.events[0],
        "MemoryTrace": timeline.memory[0],
        "Timeline": timeline,
        "Candidate": chosen.candidates[-1],
        "Plan": chosen,
        "ChunkCosts": ChunkCosts(1, 0.1, 0.2, 0.15, 0.05, 0.1 / 3, 0.3, 0.25, 1024, 512, 256,
                                 weight_bytes=128),
        "FixedBytes": FixedBytes(4096, 4096, 8192, 1 << 40),
    }


def test_every_class_that_crosses_has_a_round_trip_below() -> None:
    assert set(_instances()) == set(crosses())


@pytest.mark.parametrize("name", sorted(crosses()))
def test_every_class_that_crosses_round_trips_exactly(name: str) -> None:
    value = _instances()[name]
    assert type(value) is crosses()[name]
    back = decode(encode(value))
    assert type(back) is type(value) and back == value
    assert _same(back, value)


def test_a_plan_crosses_whole() -> None:
    chosen = _plan()
    back = decode(encode(("decided", chosen, None)))[1]
    assert isinstance(back.schedule_options, types.MappingProxyType)
    assert [type(c) for c in back.candidates] == [Candidate] * len(chosen.candidates)
    assert back == chosen and back.describe() == chosen.describe()
    assert {c.schedule for c in back.candidates} == {"1f1b", "interleaved-1f1b", "zb-v"}
    assert {"chunks_per_stage": 2} in [dict(c.schedule_options) for c in back.candidates]
    schedule = get_schedule("zb-v", 2, 4)
    assert str(decode(encode(schedule))) == str(schedule)


PLAIN = [
    None, True, False, 0, -7, 2**200, -(2**255), 1.5, -0.0, 0.1, 1e-310, 5e-324,
    1.7976931348623157e308,
    float("inf"), float("-inf"), float("nan"), "", "ünïcode \u2603 \ud800",
    (), [], {}, (1, [2, (3.0, "4")]),
    {"a": 1, 0: [None], (0, 1): (0.25, 0.5), ("x", (2, 3)): "nested key"},
    types.MappingProxyType({"chunks_per_stage": 2}),
    {"rows": [3, 3, 2, 2], "failure": None},
    ("host", 12345.678901234567),
]


@pytest.mark.parametrize("value", PLAIN, ids=[repr(v)[:30] for v in PLAIN])
def test_plain_values_round_trip_exactly(value: Any) -> None:
    assert _same(decode(encode(value)), value)


def test_tensors_round_trip_bit_for_bit() -> None:
    tensors = [torch.tensor(3.5, dtype=torch.bfloat16), torch.ones(0, 4),
               torch.tensor([True, False, True]), torch.arange(6).reshape(2, 3).t(),
               torch.randn(2, dtype=torch.complex64).conj(), torch.randn(3, requires_grad=True),
               *(torch.ones(2, 2, dtype=dtype) for dtype in DTYPES.values())]
    back = decode(encode((7, tensors, {"last": tensors[0]})))
    assert _same(back[1], [t.detach() for t in tensors]) and _same(back[2]["last"], tensors[0])
    assert not back[1][5].requires_grad


def _same(a: Any, b: Any) -> bool:
    """Equal values of exactly the same types, all the way down (NaN is NaN, -0.0 is not 0.0)."""
    array_backed = {"StageOrder", "PlanSteps", "Events"}  # cross as the tuples they read as
    if type(a) is not type(b) and not (isinstance(a, tuple) and isinstance(b, tuple) and {
            type(a).__name__, type(b).__name__} <= array_backed | {"tuple"}):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.resolve_conj(),
                                                                          b.resolve_conj())
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (dict, types.MappingProxyType)):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dataclass_fields__"):
        return all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return bool(a == b)


# -- what the sender refuses ------------------------------------------------------------------



@dataclass(frozen=True)
class Plan2:  # a dataclass of this test's: not the library's, so it may not cross
    value: int


class Opaque:
    pass


@pytest.mark.parametrize(("value", "message"), [
    ((1, {"x": [Opaque()]}), r"value\[1\]\['x'\]\[0\] is a test_no_pickle\.Opaque, which cannot "
                             r"cross to another rank: .*tensors.*Plan"),
    ({"scale": np.float64(2.0)}, r"value\['scale'\] is a numpy\.float64"),
    ([Plan2(1)], r"value\[0\] is a test_no_pickle\.Plan2"),
    ((print,), r"value\[0\] is a builtin_function_or_method"),
    ({1.5: 0}, r"dict keys crossing ranks must be str, int or tuples of them, value has a key "
               r"1\.5 of type float"),
    ({(1, None): 0}, r"key None of type NoneType"),
    (frozenset({1}), r"value is a frozenset"),
    (1 + 2j, r"value is a complex"),
    (torch.zeros(2, dtype=torch.uint16) if hasattr(torch, "uint16") else torch.zeros(1).to_sparse(),
     r"value is a .* tensor of .*, which cannot cross"),
])
def test_values_that_may_not_cross_are_refused_at_the_sender_naming_type_and_path(
        value: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        encode(value)


def test_a_value_whose_reduce_would_create_a_file_is_refused_at_the_sender(tmp_path: Path) -> None:
    target = tmp_path / "created"
    with pytest.raises(TypeError, match=r"value\[0\] is a hostile\.Evil"):
        encode([Evil(target)])
    assert not target.exists()


def test_a_value_too_deep_or_too_large_is_refused_at_the_sender() -> None:
    deep: Any = 1
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(ValueError, match=f"at most {MAX_DEPTH} containers"):
        encode(deep)
    with pytest.raises(ValueError, match="at most 256 bits"):
        encode([2**300])


# -- what the receiver refuses ----------------------------------------------------------------


def _message(document: Any, tensor_bytes: bytes = b"", raw: str | None = None) -> bytes:
    import json

    text = (raw if raw is not None else json.dumps(document)).encode()
    return len(text).to_bytes(8, "little") + text + tensor_bytes


def _doc(value: Any, tensors: Any = ()) -> dict[str, Any]:
    return {"format": 1, "value": value, "tensors": list(tensors)}


def test_a_pickle_that_would_create_a_file_is_rejected_by_the_receiver(tmp_path: Path) -> None:
    target, pickles = hostile_pickles(tmp_path, lambda evil: [evil] * 100)
    for pickled in pickles:
        with pytest.raises(StructureError, match="expected"):
            decode(pickled)
        framed = len(pickled).to_bytes(8, "little") + pickled
        with pytest.raises(StructureError, match="expected a shared value in JSON"):
            decode(framed)
    assert not target.exists()


MALFORMED = [
    (b"", "expected a message of 8 to"),
    (_message(None, raw="{"), "expected a shared value in JSON"),
    (_message(None, raw='{"format": 1, "value": 1, "value": 2, "tensors": []}'),
     "expected distinct keys"),
    ((99).to_bytes(8, "little") + b"{}", "within the 2 that follow"),
    (_message({"format": 1, "value": 1}), "an object with keys format, value and tensors"),
    (_message(_doc(1) | {"format": 2}), "expected format 1, got 2"),
    (_message(_doc(1) | {"format": True}), "expected format 1, got True"),
    (_message(_doc({"type": "os.system", "fields": {}})), "expected a type among Action, Op"),
    (_message(_doc({"type": "Opaque", "fields": {}})), "nothing else is built on a peer's word"),
    (_message(_doc({"type": "__import__", "value": "antigravity"})), "expected a type among"),
    (_message(_doc({"type": "FixedBytes", "fields": {"parameters": 1}})),
     "expected a FixedBytes with the fields parameters, gradients, optimizer, buffers"),
    (_message(_doc({"type": "FixedBytes", "fields": {"parameters": 1}, "extra": 1})),
     "expected a FixedBytes with the fields"),
    (_message(_doc({"type": "Action", "text": "X9"})),
     "could not rebuild Action from what was sent: ValueError: expected an action like"),
    (_message(_doc({"type": "Op", "value": "Z"})), "could not rebuild Op"),
    (_message(_doc({"type": "Schedule", "fields": {
        "stages": 2, "microbatches": 1, "order": {"tuple": []}, "placement": {"tuple": []},
        "name": "x", "forward_only": False}})),
     "could not rebuild Schedule from what was sent: ValueError: order must have one action"),
    (_message(_doc({"set": [1]})), "expected a value tagged tuple, list, dict, mapping, or tensor"),
    (_message(_doc({"tuple": [], "list": []})), "expected a value"),
    (_message(_doc({"dict": [[[1], 2]]})), "expected a str, int or tuple key"),
    (_message(_doc({"dict": [["a", 1], ["a", 2]]})), "expected distinct dict keys"),
    (_message(_doc(2**300)), "expected an int of at most 256 bits"),
    (_message(None, raw='{"format": 1, "value": ' + "1" * 5000 + ', "tensors": []}'),
     "expected an int of at most 256 bits"),
    (_message(None, raw='{"format": 1, "value": 1.' + "0" * 40 + ', "tensors": []}'),
     "expected a float as repr"),
    (_message(None, raw="[" * 100000 + "]" * 100000), "expected a shared value in JSON"),
    (_message(_doc({"tensor": 0})), "expected a value tagged .* tensor 0 of the 0"),
    (_message(_doc({"tensor": 1}, [["uint8", [1]], ["uint8", [1]]]), b"ab"), "tensor 0 of the 2"),
    (_message(_doc({"list": []}, [["uint8", [1]]]), b"a"), "places each of the 1 tensors"),
    (_message(_doc({"tensor": 0}, [["float32", [2]]]), b"abc"),
     "8 bytes of tensor data, at most what is left, got 3"),
    (_message(_doc({"tensor": 0}, [["uint8", [1]]]), b"ab"),
     "1 bytes of tensor data in all, got 2"),
    (_message(_doc({"tensor": 0}, [["object", [1]]]), b"a"), "a dtype among float64"),
    (_message(_doc({"tensor": 0}, [["uint8", [-1]]]), b"a"), "a dtype among"),
    (_message(_doc({"tensor": 0}, [["bool", [1]]]), b"\x02"), "bools as bytes 0 and 1"),
]


@pytest.mark.parametrize(("data", "message"), MALFORMED)
def test_malformed_messages_raise_a_clear_value_error(data: bytes, message: str) -> None:
    with pytest.raises(StructureError, match=message) as caught:
        decode(data)
    assert isinstance(caught.value, ValueError)


def test_the_json_of_a_message_is_bounded() -> None:
    with pytest.raises(StructureError, match=f"JSON of at most {MAX_JSON_BYTES}"):
        decode((MAX_JSON_BYTES + 1).to_bytes(8, "little") + b" " * 16)


# -- on two gloo ranks ------------------------------------------------------------------------


def on_ranks(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    group, results = dist.group.WORLD, {}
    mine = {"rank": rank, "costs": {rank: ChunkCosts(rank, 0.5, 1.0, 0.0, 0.0, 0.5, 1.5, 0.0,
                                                     8, 4, 4)},
            "links": {(0, 1): (1e-5 * (rank + 1), 2e-3)}, "tensor": torch.full((2,), rank)}
    gathered = gather_objects(mine, group, 10.0, "sharing test values")
    results["gathered"] = [(entry["rank"], entry["costs"], entry["links"],
                            entry["tensor"].tolist()) for entry in gathered]
    results["broadcast"] = broadcast_object(get_schedule("zb-v", 2, 4) if rank == 0 else None,
                                            0, group, 10.0, "sharing a schedule")
    for case, refusing in (("one refuses", (0,)), ("both refuse", (0, 1))):
        start = time.monotonic()
        try:
            gather_objects([Opaque()] if rank in refusing else [1], group, 10.0, "a test")
            results[case] = (None, "", time.monotonic() - start)
        except Exception as error:  # noqa: BLE001 - reported to the test
            results[case] = (type(error).__name__, str(error), time.monotonic() - start)
    results["after"] = gather_objects(rank, group, 10.0, "a last gather")
    made = pipeline_groups(group, [rank], 1)  # one pipeline of one rank each: gathered first
    results["groups"] = [dist.get_world_size(g) for g in made]
    return results


@cache
def rank_results() -> list[dict[str, Any]]:
    return run_ranks(on_ranks, 2, timeout=120.0)


def test_registered_values_gather_on_every_rank() -> None:
    expected = [(r, {r: ChunkCosts(r, 0.5, 1.0, 0.0, 0.0, 0.5, 1.5, 0.0, 8, 4, 4)},
                 {(0, 1): (1e-5 * (r + 1), 2e-3)}, [r, r]) for r in range(2)]
    for results in rank_results():
        assert results["gathered"] == expected
        assert results["broadcast"] == get_schedule("zb-v", 2, 4)
        assert results["after"] == [0, 1]  # the group still works after a refusal
        assert results["groups"] == [1]


@pytest.mark.parametrize("case", ["one refuses", "both refuse"])
def test_an_unregistered_value_is_refused_at_the_sender_on_every_rank(case: str) -> None:
    for results in rank_results():
        kind, message, seconds = results[case]
        assert kind == "TypeError", message
        assert message.startswith("rank 0 could not send its part of a test: value[0] is a "
                                  "test_no_pickle.Opaque, which cannot cross to another rank")
        assert seconds < 10  # refused, not waited out
