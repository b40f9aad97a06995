"""pipe-balance: the table, JSON and PNG it writes, and one-line errors (exit 2), in a subprocess
where the process is what is tested (the console script, ``-m``, exit statuses), else in process."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from partitioners.cli.command import main

HERE = Path(__file__).absolute().parent
ROOT = HERE.parents[2]  # the checkout under test, ahead of any installed copy
SCRIPT = Path(sys.executable).parent / "pipe-balance"


def run(args: list[str], cwd: Path, script: bool = False) -> subprocess.CompletedProcess[str]:
    command = [str(SCRIPT)] if script else [sys.executable, "-m", "partitioners"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT)]))
    return subprocess.run(
        command + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(not SCRIPT.exists(), reason="the pipe-balance script is not installed")
def test_console_script_writes_table_json_and_png(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    # From the factory's own directory, without PYTHONPATH: the current directory imports.
    result = subprocess.run(
        [str(SCRIPT), "cli_factories:mlp", "--input-shape", "16,32", "--stages", "4",
         "--chunks", "6", "--schedule", "gpipe", "--threads", "1", "--repeat", "2",
         "--json", str(out_json), "--plot", str(out_png)],
        cwd=HERE, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    words = ("stage", "fwd ms", "bwd ms", "share", "imbalance", "step time", "bubble", "uniform")
    for text in words:
        assert text in result.stdout
    data = json.loads(out_json.read_text())
    assert next(iter(data)) == "balance"
    assert sum(data["balance"]) == 12 and len(data["balance"]) == 4
    assert len(data["stages"]) == 4 and data["stages"][0]["layers"][0] == 0
    assert data["stages"][-1]["layers"][1] == 11
    assert data["imbalance"] >= 1.0
    assert data["predicted"]["schedule"] == "gpipe" and data["predicted"]["microbatches"] == 6
    assert 0 < data["predicted"]["bubble_fraction"] < 1
    assert data["uniform"]["balance"] == [3, 3, 3, 3]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out_png.stat().st_size > 10_000




SUBPROCESS_ERRORS = [
    (["cli_factories:exits", "--input-shape", "4,32", "--stages", "2"],
     "cli_factories:exits() called sys.exit(0); expected it to return an nn.Module"),
    (["cli_factories:mlp", "--input-shape", "1000000,1000000", "--stages", "2"],
     "cannot allocate the --input-shape 1000000,1000000 sample: 3.64 TiB"),
]


@pytest.mark.parametrize(("args", "message"), SUBPROCESS_ERRORS, ids=[
    "factory-exits", "input-too-large",
])
def test_errors_exit_2_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    # In a real process: the exit status, and no traceback, are what a shell sees.
    result = run(args + ["--threads", "1"], cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pipe-balance: error: ")
    assert message in lines[0]


# In process from here on (main() with the arguments a shell would pass): a fresh interpreter
# costs seconds of imports, and what these check is the CLI's work, not the process's.
# The tests above keep the console script, ``python -m partitioners`` and exit statuses.


def test_a_model_as_written_is_traced_into_units(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A factory returning a Hugging Face Llama, token ids as input: its units are cut, and
    the table and the JSON name them as the model does (not "Unit x3")."""
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.chdir(tmp_path)
    status = main(["cli_factories:tiny_llama", "--input-shape", "4,12", "--dtype", "long",
                   "--stages", "2", "--threads", "1", "--repeat", "1", "--no-progress",
                   "--json", "o.json"])
    out, err = capsys.readouterr()
    assert status == 0, err
    data = json.loads((tmp_path / "o.json").read_text())
    assert sum(data["balance"]) == 5 and len(data["balance"]) == 2  # prologue, 3 blocks, epilogue
    names = [name for stage in data["stages"] for name in stage["types"]]
    assert names == ["(prologue)", "model.layers.0", "model.layers.1", "model.layers.2",
                     "(epilogue)"]
    table = out.split("\n\n")[1]  # the stage table; the cut itself depends on the timings
    assert "Unit" not in table and "(prologue)" in table, out
    assert re.search(r"model\.layers\.(\d-)?2\b", table), out  # "model.layers.1-2" by the cut


def test_a_run_with_memory_limit_and_bandwidth(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        # Python's default filters, as a fresh interpreter's stderr would show warnings
        warnings.resetwarnings()
        warnings.simplefilter("default")
        for hidden in (DeprecationWarning, PendingDeprecationWarning, ImportWarning,
                       ResourceWarning):
            warnings.filterwarnings("ignore", category=hidden)
        status = main(["cli_factories:mlp", "--input-shape", "16,32", "--stages", "3",
                       "--threads", "1", "--memory-limit", "1GiB", "--bandwidth", "10GB/s",
                       "--no-progress", "--json", "o.json"])
    err = capsys.readouterr().err
    assert status == 0, err
    assert err == "" and [str(warning.message) for warning in caught] == []
    assert sum(json.loads((tmp_path / "o.json").read_text())["balance"]) == 12


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["cli_factories", "--input-shape", "4", "--stages", "1"], "expected MODULE:FACTORY"),
        (["m:f", "--input-shape", "4", "--stages", "0"], "--stages must be >= 1, got 0"),
        (["m:f", "--input-shape", "4;0,2", "--stages", "1"], "malformed --input-shape"),
        (["m:f", "--input-shape", "4", "--stages", "1", "--memory-limit", "8XB"], "--memory-limit"),
        (["m:f", "--input-shape", "4", "--stages", "1", "--memory-limit", "2GiB/s"],
         "--memory-limit: expected a size"),
        (["m:f", "--input-shape", "4", "--stages", "1", "--chunks", "0"], "--chunks must be >= 1"),
        (["cli_factories:NOT_CALLABLE", "--input-shape", "4", "--stages", "1"],
         "expected a callable"),
        (["cli_factories:mlp", "--input-shape", "4,32", "--stages", "1", "--dtype", "float99"],
         "unknown dtype 'float99'"),
        (["cli_factories:mlp", "--input-shape", "4,31", "--stages", "1"],
         "profiling layer 0 (Linear) failed"),
        (["m:f", "--input-shape", "4"], "the following arguments are required: --stages"),
        (["no_such_module_xyz:build", "--input-shape", "4,32", "--stages", "2"],
         "cannot import module 'no_such_module_xyz'"),
        (["cli_factories:missing", "--input-shape", "4,32", "--stages", "2"],
         "module 'cli_factories' has no attribute 'missing'"),
        (["cli_factories:not_sequential", "--input-shape", "4,32", "--stages", "2"],
         "Linear has no run of same-class blocks"),
        (["cli_factories:mlp", "--input-shape", "4,x", "--stages", "2"],
         "malformed --input-shape '4,x'"),
        (["cli_factories:mlp", "--input-shape", "4,32", "--stages", "13"],
         "cannot cut 12 layers into 13 non-empty stages"),
        (["cli_factories:mlp", "--input-shape", "4,32", "--stages", "2", "--memory-limit", "1KiB"],
         "the smallest limit that fits is"),
        (["cli_factories:empty", "--input-shape", "4,32", "--stages", "1"], "empty nn.Sequential"),
        (["cli_factories:exits", "--input-shape", "4,32", "--stages", "1"],
         "cli_factories:exits() called sys.exit(0)"),
        (["cli_factories:mlp", "--input-shape", "100000,100000", "--stages", "1"],
         "cannot allocate the --input-shape 100000,100000 sample: 37.25 GiB"),
        (["cli_factories:mlp", "--input-shape", "4,32", "--stages", "1", "--device", "cuda:99"],
         "--device cuda:99"),
        (["cli_factories:mlp", "--input-shape", "4,32", "--stages", "1", "--device", "nowhere"],
         "'nowhere'"),
        (["cli_factories:mlp", "--input-shape", "4,32", "--stages", "1", "--repeat", "0"],
         "repeat must be an int >= 1, got 0"),
        (["cli_factories:mlp", "--input-shape", "4,32", "--stages", "2",
          "--schedule", "interleaved-1f1b"], "places"),
        (["cli_factories:mlp", "--input-shape", "4,32", "--stages", "1", "--threads", "0"],
         "--threads must be >= 1, got 0"),
    ],
)
def test_more_errors_in_process(
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    try:
        status = main(args + ["--no-progress"])
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2
    assert len(err.strip().splitlines()) == 1 and message in err, err


def huge_sample_fails_to_allocate(*args: object, **kwargs: object) -> None:
    raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate")


def test_an_allocation_that_fails_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under physical memory but refused anyway (another process holds the memory).
    import torch

    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setattr(torch, "randn", huge_sample_fails_to_allocate)
    status = main(["cli_factories:mlp", "--input-shape", "1000,32", "--stages", "1",
                   "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert "cannot allocate the --input-shape 1000,32 sample: 125.0 KiB" in err
    assert "the allocation failed; reduce --input-shape" in err


@pytest.mark.parametrize("factory", ["in_place", "tied"])
def test_in_place_and_tied_models_get_a_table(
    factory: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from cli_factories import tied

    monkeypatch.syspath_prepend(str(HERE))
    shape = "8,32" if factory == "in_place" else "8,5"
    dtype = "float32" if factory == "in_place" else "int64"
    status = main([f"cli_factories:{factory}", "--input-shape", shape, "--dtype", dtype,
                   "--stages", "2", "--threads", "1", "--repeat", "1", "--no-progress"])
    out, err = capsys.readouterr()
    assert status == 0, err
    total = next(line for line in out.splitlines() if line.startswith("total"))
    if factory == "tied":
        unique = sum(p.numel() * p.element_size() for p in tied().parameters())
        assert unique == (100 * 16 + 16 * 16 + 16) * 4
        assert total.rstrip().endswith("7.31 KiB"), total  # 7488 bytes, the tied weight once
        assert unique == 7488
    assert torch.get_num_threads() == 1


def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        status = main(args + ["--no-progress", "--threads", "1", "--repeat", "1", "--warmup", "0"])
    except SystemExit as exit_:  # argparse's own errors
        status = int(exit_.code or 0)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_auto_prints_the_best_candidates_and_writes_them_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    out = tmp_path / "plan.json"
    status, text, err = _main(["cli_factories:mlp", "--input-shape", "16,32", "--stages", "2",
                               "--schedule", "auto", "--chunks", "auto", "--memory-limit", "512MiB",
                               "--top", "3", "--json", str(out)], capsys)
    assert status == 0, err
    for word in ("schedule", "M", "balance", "checkpoint", "step ms", "bubble",
                 "peak memory per stage", "pick: ", "memory limit 512.0 MiB"):
        assert word in text
    data = json.loads(out.read_text())
    assert next(iter(data)) == "pick"
    candidates = data["candidates"]
    assert candidates[0] == data["pick"] and len(text.splitlines()) == 2 + 2 + 3 + 2
    assert data["memory_limit"] == 512 * 2**20
    assert all(c["fits"] and max(c["peak_memory_bytes"]) <= 512 * 2**20 for c in candidates)
    steps = [c["step_time_ms"] for c in candidates]
    assert steps == sorted(steps)
    pick = data["pick"]
    assert sum(pick["balance"]) == 12 and pick["checkpoint"] in ("never", "except_last", "always")
    assert f"pick: {pick['schedule']}" in text


def test_auto_chunks_with_a_fixed_schedule_and_the_reverse(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    out = tmp_path / "plan.json"
    base = ["cli_factories:mlp", "--input-shape", "12,32", "--stages", "2", "--json", str(out)]
    status, _, err = _main(base + ["--schedule", "1f1b", "--chunks", "auto",
                                   "--memory-limit", "1e9"], capsys)
    assert status == 0, err
    chosen = json.loads(out.read_text())["candidates"]
    assert {c["schedule"] for c in chosen} == {"1f1b"}
    assert chosen and all(1 <= c["microbatches"] <= 12 for c in chosen)
    status, _, err = _main(base + ["--schedule", "auto", "--chunks", "5"], capsys)
    assert status == 0, err
    chosen = json.loads(out.read_text())["candidates"]
    assert {c["microbatches"] for c in chosen} == {5}  # 12 rows into 5: uneven, 3 3 2 2 2


@pytest.mark.parametrize(("args", "message"), [
    (["--memory-limit", "1KiB"], "the smallest limit that fits is"),
    (["--memory-limit", "2GiBs"], "--memory-limit"),
    (["--chunks", "lots"], "expected an int or auto, got 'lots'"),
    (["--top", "0"], "--top must be >= 1, got 0"),
    (["--plot", "x.png"], "--plot draws one cut"),
    (["--chunks", "9"], "microbatch_counts: expected ints in 1..8"),
])
def test_auto_errors_exit_2_with_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    status, _, err = _main(["cli_factories:mlp", "--input-shape", "8,32", "--stages", "2",
                            "--schedule", "auto", *args], capsys)
    assert status == 2
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_auto_plans_for_sharded_replicas(capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With Adam's state (--optimizer-factor 2), FSDP over 4 replicas fits a stage in less
    memory than whole copies do, and a limit between the two is met only with --fsdp."""
    monkeypatch.syspath_prepend(str(HERE))
    base = ["cli_factories:mlp", "--input-shape", "16,32", "--stages", "2", "--schedule", "auto",
            "--chunks", "auto", "--optimizer-factor", "2"]

    def smallest(*extra: str) -> int:
        status, _, err = _main(base + ["--memory-limit", "1KiB", *extra], capsys)
        assert status == 2, err
        return int(err.split("the smallest limit that fits is")[1].split("(")[1].split()[0])

    whole, sharded = smallest("--replicas", "4"), smallest("--replicas", "4", "--fsdp")
    assert sharded < 0.9 * whole, (sharded, whole)
    between = str((sharded + whole) // 2)
    assert _main(base + ["--memory-limit", between, "--replicas", "4", "--fsdp"], capsys)[0] == 0
    assert _main(base + ["--memory-limit", between, "--replicas", "4"], capsys)[0] == 2


@pytest.mark.parametrize(("args", "message"), [
    (["--schedule", "auto", "--fsdp"], "--fsdp shards a stage over its replicas"),
    (["--schedule", "auto", "--replicas", "2", "--reshard-after-forward"], "it needs --fsdp"),
    (["--schedule", "auto", "--replicas", "0"], "--replicas must be >= 1, got 0"),
    (["--replicas", "2"], "use them with --schedule auto or --chunks auto"),
])
def test_replica_options_are_checked(args: list[str], message: str,
                                     capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    status, _, err = _main(["cli_factories:mlp", "--input-shape", "8,32", "--stages", "2",
                            *args], capsys)
    assert status == 2 and message in err, err
