"""Checkpoints you can trust (issue 31): saving changes nothing, loading is strict, keeps ties
and verifies every file it reads, no byte of a checkpoint or of a peer runs code, and a
silent or stalled peer is a PeerError within the Pipe's timeout.

One process here; two gloo ranks through ``checkpoint_trust_workers``.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from checkpoint_trust_workers import (
    BOUND,
    BOUNDED_LAUNCHES,
    FRESH_OPTIMIZERS,
    SAVES,
    STALL,
    Evil,
    bounded_waits,
    corrupt_files,
    fresh_saves,
    hostile_peer,
    tied_mlp,
    train_saving,
    untied_into_tied,
)
from checkpoint_workers import CHUNKS, named_parameters
from dist_harness import in_turn, run_ranks
from dist_workers import deep_mlp
from pipeline import Pipe
from pipeline.saving.checkpoints import (
    MANIFEST_FILE,
    METADATA_FILE,
    CheckpointError,
    load_checkpoint,
    load_into_model,
    save_checkpoint,
    save_model_checkpoint,
)


def _local_pipe(model: nn.Sequential | None = None) -> Pipe:
    torch.set_num_threads(1)
    return Pipe(model if model is not None else deep_mlp(), chunks=CHUNKS,
                devices=["cpu", "cpu"], loss_fn=nn.MSELoss())


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(torch.as_tensor(a[k]),
                                                      torch.as_tensor(b[k])) for k in a)


def _worst(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float((torch.as_tensor(a[k]) - torch.as_tensor(b[k])).abs().max()) for k in a)


# -- row 3: saving changes nothing -----------------------------------------------------------


def _trained(name: str, save: str, directory: Path | None) -> dict[str, torch.Tensor]:
    pipe = _local_pipe()
    train_saving(pipe, FRESH_OPTIMIZERS[name](pipe.parameters()), directory, save)
    pipe.close()
    return named_parameters(pipe.model)


@pytest.mark.parametrize("save", SAVES[1:])
@pytest.mark.parametrize("name", sorted(FRESH_OPTIMIZERS))
def test_a_save_before_the_first_step_changes_nothing(tmp_path: Path, name: str,
                                                      save: str) -> None:
    plain = _trained(name, SAVES[0], None)
    saved = _trained(name, save, tmp_path / "ckpt")
    assert _equal(saved, plain), f"{_worst(saved, plain)} off"


@pytest.mark.parametrize("name", sorted(FRESH_OPTIMIZERS))
def test_a_fresh_optimizer_resumes_as_if_never_saved(tmp_path: Path, name: str) -> None:
    plain = _trained(name, SAVES[0], None)
    _trained(name, SAVES[1], tmp_path / "ckpt")
    pipe = _local_pipe()
    optimizer = FRESH_OPTIMIZERS[name](pipe.parameters())
    assert load_checkpoint(pipe, optimizer, tmp_path / "ckpt") == 0
    assert not optimizer.state  # saved without state, loaded without state
    train_saving(pipe, optimizer, None, SAVES[0])
    assert _equal(named_parameters(pipe.model), plain)
    pipe.close()


def test_a_save_keeps_gradients_and_optimizer_state(tmp_path: Path) -> None:
    pipe = _local_pipe()
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.01)
    train_saving(pipe, optimizer, None, SAVES[0])
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    pipe.step(x, y)
    grads = {n: p.grad.clone() for n, p in pipe.model.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    save_checkpoint(pipe, optimizer, tmp_path / "ckpt", 3)
    assert all(torch.equal(p.grad, grads[n]) for n, p in pipe.model.named_parameters())
    assert all(torch.equal(v, state[id(p)][k]) for p, s in optimizer.state.items()
               for k, v in s.items())
    pipe.close()


# -- row 7 and 16: strict, with ties ---------------------------------------------------------


def _untied(path: Path) -> None:
    """An untied model's checkpoint, every value other than the tied model's."""
    untied = tied_mlp(tied=False)
    with torch.no_grad():
        for parameter in untied.parameters():
            parameter.mul_(2.0)
    save_model_checkpoint(untied, None, path, 1)


def test_an_untied_checkpoint_is_refused_by_a_tied_model(tmp_path: Path) -> None:
    _untied(tmp_path / "untied")
    tied = tied_mlp()
    before = named_parameters(tied)
    with pytest.raises(CheckpointError, match=r"model\.0\.weight and model\.14\.weight are one "
                                              r"parameter in this model \(tied\), but the "
                                              r"checkpoint .* holds different values"):
        load_into_model(tied, None, tmp_path / "untied")
    assert _equal(named_parameters(tied), before)
    pipe = _local_pipe(tied_mlp())
    with pytest.raises(CheckpointError, match=r"model\.0\.weight and model\.14\.weight .*tied"):
        load_checkpoint(pipe, None, tmp_path / "untied")
    assert _equal(named_parameters(pipe.model), before)
    pipe.close()


def test_a_tied_checkpoint_loads_into_the_tied_model(tmp_path: Path) -> None:
    source = tied_mlp()
    with torch.no_grad():
        source[0].weight.mul_(3.0)
    optimizer = torch.optim.Adam(source.parameters())
    save_model_checkpoint(source, optimizer, tmp_path / "tied", 4)
    pipe = _local_pipe(tied_mlp())
    assert load_checkpoint(pipe, torch.optim.Adam(pipe.parameters()), tmp_path / "tied") == 4
    assert pipe.model[0].weight is pipe.model[14].weight
    assert _equal(named_parameters(pipe.model), named_parameters(source))
    pipe.close()


@pytest.fixture
def plain_checkpoint(tmp_path: Path) -> Path:
    model = deep_mlp()
    optimizer = torch.optim.Adam(model.parameters())
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    nn.MSELoss()(model(x), y).backward()
    optimizer.step()
    save_model_checkpoint(model, optimizer, tmp_path / "ckpt", 1)
    return tmp_path / "ckpt"


def _refusal(model: nn.Module, path: Path, optimizer: bool = True) -> CheckpointError:
    made = torch.optim.Adam(model.parameters()) if optimizer else None
    with pytest.raises(CheckpointError) as caught:
        load_into_model(model, made, path)
    error = caught.value
    assert isinstance(error, Exception) and isinstance(error, ValueError)
    assert len(str(error)) < 700, str(error)
    return error


def test_a_bigger_models_checkpoint_is_refused_naming_the_unexpected_keys(
        plain_checkpoint: Path) -> None:
    message = str(_refusal(deep_mlp(blocks=7), plain_checkpoint))
    assert "missing keys [] (0), unexpected keys [model.14.bias, model.14.weight, optim.*.14.bias" \
        in message, message


def test_a_smaller_models_checkpoint_is_refused_naming_the_missing_keys(tmp_path: Path) -> None:
    save_model_checkpoint(deep_mlp(blocks=7), None, tmp_path / "small", 1)
    message = str(_refusal(deep_mlp(), tmp_path / "small", optimizer=False))
    assert "missing keys [model.14.bias, model.14.weight] (2), unexpected keys [] (0)" in message
    message = str(_refusal(deep_mlp(blocks=7), tmp_path / "small"))
    assert "missing keys [optim.param_groups.0.bias.*, optim.param_groups.0.weight.*" in message
    assert "or without an optimizer" in message


def test_a_wider_layer_is_refused_naming_both_shapes(plain_checkpoint: Path) -> None:
    wider = deep_mlp()
    wider[0] = nn.Linear(6, 9).double()
    wider[2] = nn.Linear(9, 6).double()
    message = str(_refusal(wider, plain_checkpoint))
    assert "model.0.bias: saved (6,), this model (9,); model.0.weight: saved (6, 6), this " \
           "model (9, 6); model.2.weight: saved (6, 6), this model (6, 9)" in message


def test_a_refused_load_changes_nothing(plain_checkpoint: Path) -> None:
    wider = deep_mlp(blocks=7)
    before = named_parameters(wider)
    _refusal(wider, plain_checkpoint)
    assert _equal(named_parameters(wider), before)


# -- row 8: digests ---------------------------------------------------------------------------


def _flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x01
    path.write_bytes(bytes(data))


def test_one_flipped_byte_in_a_shard_is_refused_naming_the_file(plain_checkpoint: Path) -> None:
    shard = plain_checkpoint / "__0_0.distcp"
    for at in (100, len(shard.read_bytes()) // 2, len(shard.read_bytes()) - 1):
        _flip(shard, at)
        model = deep_mlp()
        before = named_parameters(model)
        with pytest.raises(CheckpointError, match=rf"{shard} is not the file that was saved "
                                                  r"\(its SHA-256 digest differs\)"):
            load_into_model(model, None, plain_checkpoint)
        assert _equal(named_parameters(model), before)
        _flip(shard, at)
    assert load_into_model(deep_mlp(), None, plain_checkpoint) == 1  # the same bytes load


def test_an_empty_or_changed_metadata_is_refused_naming_it(plain_checkpoint: Path) -> None:
    metadata = plain_checkpoint / METADATA_FILE
    _flip(metadata)
    with pytest.raises(CheckpointError, match=rf"{metadata} is not the file that was saved"):
        load_into_model(deep_mlp(), None, plain_checkpoint)
    metadata.write_bytes(b"")
    with pytest.raises(CheckpointError, match=rf"{metadata} is not the file that was saved "
                                              r"\(0 bytes where \d+ were saved\)"):
        load_into_model(deep_mlp(), None, plain_checkpoint)


def test_a_changed_or_missing_manifest_is_refused(plain_checkpoint: Path) -> None:
    manifest = plain_checkpoint / MANIFEST_FILE
    text = manifest.read_text()
    manifest.write_text(text.replace('"bytes": ', '"bytes": 1', 1))
    with pytest.raises(CheckpointError, match=rf"{manifest} is corrupt: its digest does not "
                                              r"match its contents"):
        load_into_model(deep_mlp(), None, plain_checkpoint)
    manifest.write_text(text[:-3])
    with pytest.raises(CheckpointError, match=rf"{manifest} is corrupt: expected a checkpoint "
                                              r"manifest in JSON"):
        load_into_model(deep_mlp(), None, plain_checkpoint)
    manifest.unlink()
    with pytest.raises(CheckpointError, match=r"has no \.checkpoint\.json .* a pickle that "
                                              r"pipesched does not unpickle"):
        load_into_model(deep_mlp(), None, plain_checkpoint)


# -- row 9: no code runs from a checkpoint's bytes -------------------------------------------


def _rewrite_manifest(directory: Path, change: Any) -> None:
    """Change the manifest's body and sign it again, as an attacker who writes the whole
    directory would."""
    manifest = directory / MANIFEST_FILE
    document = json.loads(manifest.read_text())
    change(document["body"])
    canonical = json.dumps(document["body"], sort_keys=True, separators=(",", ":")).encode()
    document["sha256"] = hashlib.sha256(canonical).hexdigest()
    manifest.write_text(json.dumps(document))


def _digest(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_crafted_metadata_that_would_create_a_file_runs_nothing(plain_checkpoint: Path,
                                                                  tmp_path: Path) -> None:
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(Evil(str(proof))))  # the gadget works where pickle is trusted
    assert proof.exists()
    created = tmp_path / "created"
    metadata = plain_checkpoint / METADATA_FILE
    metadata.write_bytes(pickle.dumps(Evil(str(created))))
    with pytest.raises(CheckpointError, match=rf"{metadata} is not the file that was saved"):
        load_into_model(deep_mlp(), None, plain_checkpoint)
    assert not created.exists()
    # Signed again with the crafted file's digest: .metadata is never unpickled at all.
    _rewrite_manifest(plain_checkpoint,
                      lambda body: body["files"].update({METADATA_FILE: _digest(metadata)}))
    model = deep_mlp(blocks=8)
    assert load_into_model(model, torch.optim.Adam(model.parameters()), plain_checkpoint) == 1
    assert not created.exists()


def test_a_crafted_entry_that_would_create_a_file_runs_nothing(plain_checkpoint: Path,
                                                               tmp_path: Path) -> None:
    created = tmp_path / "created"
    evil = plain_checkpoint / "__9_0.distcp"
    torch.save(Evil(str(created)), evil)  # a bytes entry, as torch.save writes one
    entries = ("optim.param_groups.0.weight.lr", "model.0.weight")

    def point(body: dict[str, Any]) -> None:
        body["files"]["__9_0.distcp"] = _digest(evil)
        for entry in body["metadata"]["storage"]:
            if entry["index"]["fqn"] in entries:
                entry["storage"] = {"file": "__9_0.distcp", "at": 0, "length": evil.stat().st_size}

    _rewrite_manifest(plain_checkpoint, point)
    model = deep_mlp()
    with pytest.raises(CheckpointError, match=r"reading the checkpoint: UnpicklingError: "
                                              r"Weights only load failed"):
        load_into_model(model, torch.optim.Adam(model.parameters()), plain_checkpoint)
    assert not created.exists()


def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(
        plain_checkpoint: Path) -> None:
    def outside(body: dict[str, Any]) -> None:
        body["metadata"]["storage"][0]["storage"]["file"] = "../../etc/passwd"

    _rewrite_manifest(plain_checkpoint, outside)
    with pytest.raises(CheckpointError, match=r"expected a data file named like "
                                              r"__0_0\.distcp, got '\.\./\.\./etc/passwd'"):
        load_into_model(deep_mlp(), None, plain_checkpoint)


def test_dcp_own_tools_still_read_the_directory(plain_checkpoint: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(plain_checkpoint, tmp_path / "whole.pt")  # DCP unpickles our .metadata
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    model = deep_mlp()
    load_into_model(model, None, plain_checkpoint)
    assert _equal({k: v for k, v in whole["model"].items()}, model.state_dict())
    assert int(whole["step"]) == 1 and whole["optim"]["param_groups"]["0.weight"]["lr"] == 1e-3


# -- on two gloo ranks ------------------------------------------------------------------------


@cache
def _two_ranks(directory: str) -> list[list[Any]]:
    """Per rank, each call's result. ``bounded_waits``, whose ranks mostly sleep or wait
    (and leave broken groups), runs each of ``BOUNDED_LAUNCHES`` on two ranks of its own,
    all while the others run; per rank, the cases' results in one dict, last."""
    base = Path(directory)
    _untied(base / "untied")
    calls = [(fresh_saves, (str(base / "fresh"),)), (untied_into_tied, (str(base / "untied"),)),
             (corrupt_files, (str(base / "corrupt"),)), (hostile_peer, (str(base / "hostile"),))]
    for sub in ("fresh", "corrupt", "hostile"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    for index in range(len(BOUNDED_LAUNCHES)):
        (base / f"bounded/{index}").mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=len(BOUNDED_LAUNCHES)) as pool:
        waits = [pool.submit(run_ranks, bounded_waits, 2, str(base / f"bounded/{index}"), cases)
                 for index, cases in enumerate(BOUNDED_LAUNCHES)]
        others = run_ranks(in_turn, 2, calls)
        bounded = [wait.result() for wait in waits]
    return [[*(_tensors(result) for result in results),
             {case: found for launch in bounded for case, found in launch[rank].items()}]
            for rank, results in enumerate(others)]


def _tensors(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {key: _tensors(value) for key, value in tree.items()}
    return torch.from_numpy(tree) if isinstance(tree, np.ndarray) else tree


@pytest.fixture(scope="module")
def two_ranks_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("two_ranks")


@pytest.fixture(scope="module")
def two_ranks(two_ranks_directory: Path) -> list[list[Any]]:
    return _two_ranks(str(two_ranks_directory))


def test_on_two_ranks_a_save_before_the_first_step_changes_nothing(
        two_ranks: list[list[Any]]) -> None:
    for name in FRESH_OPTIMIZERS:
        merged: dict[str, dict[str, torch.Tensor]] = {}
        for results in two_ranks:
            for key, parameters in results[0].items():
                if key.startswith(f"{name}/"):
                    merged.setdefault(key, {}).update(parameters)
        plain = merged[f"{name}/{SAVES[0]}"]
        assert plain == {} or len(plain) == 16
        for save in (*SAVES[1:], "resumed"):
            assert _equal(merged[f"{name}/{save}"], plain), (name, save)
        assert _equal(plain, _trained(name, SAVES[0], None))


def test_dcp_own_tools_read_a_two_rank_checkpoint_whole(two_ranks: list[list[Any]],
                                                        two_ranks_directory: Path,
                                                        tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(two_ranks_directory / "fresh" / "adam-1", tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert _equal(whole["model"], deep_mlp().state_dict())  # saved before the first step
    assert "state" not in whole["optim"] and len(whole["optim"]["param_groups"]) == 16


def test_on_two_ranks_an_untied_checkpoint_is_refused_on_every_rank(
        two_ranks: list[list[Any]]) -> None:
    results = [ranks[1] for ranks in two_ranks]
    assert [r["layers"][0] for r in results] == [0, 8] and 14 in results[1]["layers"]
    for result in results:
        assert result["kind"] == "CheckpointError", result["message"]
        assert "model.0.weight and model.14.weight are one parameter in this model (tied)" \
            in result["message"]
        assert result["unchanged"]


def test_on_two_ranks_a_corrupt_file_is_refused_on_every_rank_naming_it(
        two_ranks: list[list[Any]]) -> None:
    for ranks in two_ranks:  # a rank that reads the file names it, the others name that rank
        kind, message = ranks[2]["flipped"]
        assert kind == "CheckpointError"
        assert "__1_0.distcp is not the file that was saved (its SHA-256 digest differs)" in message
        kind, message = ranks[2]["empty"]
        assert kind == "CheckpointError" and ".metadata is not the file that was saved (0 " \
            "bytes where" in message


def test_on_two_ranks_nothing_a_peer_sends_runs_code(two_ranks: list[list[Any]]) -> None:
    for rank, ranks in enumerate(two_ranks):
        found = ranks[3]
        kind, message = found["object"]
        assert kind == "TypeError" and "rank 1 could not send its part of planning the save: " \
            "value['value']['extra'] is a hostile.Evil, which cannot cross" \
            in message, message
        kind, message = found["path"]
        assert kind == "CheckpointError" and "rank 1's write results[0].storage.file: expected " \
            "a data file named like __0_0.distcp, got '../../outside.distcp'" in message, message
        assert not found["created"]
        assert found["published"] == []  # nothing published, and a failed save leaves nothing


def test_with_a_silent_or_stalled_peer_every_waiting_rank_raises_within_the_bound(
        two_ranks: list[list[Any]]) -> None:
    """Pipe(timeout=2): each waiting rank raises PeerError within BOUND (6 s), not when the
    silent or stalled peer wakes (past BOUND), nor at a default timeout."""
    per_rank = [ranks[4] for ranks in two_ranks]
    assert sorted(per_rank[0]) == sorted(("save, silent peer", "load, silent peer",
                                          "save, stalled peer", "load, stalled peer"))
    for case, (kind, message, seconds) in per_rank[0].items():
        assert kind == "PeerError" and seconds < BOUND, (case, kind, message, seconds)
    for case in ("save, stalled peer", "load, stalled peer"):  # it waits for rank 0 in turn
        kind, _, seconds = per_rank[1][case]
        assert kind == "PeerError" and STALL < seconds < STALL + BOUND
