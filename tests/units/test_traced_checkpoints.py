"""Checkpoints of a traced model are keyed by the model's own names: a pipeline's loads into
the plain model (load_into_model), the plain model's into a pipeline cut another way (one
process here; two ranks in test_traced_ranks.py, in its one spawn)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from pipeline import Pipe, load_checkpoint, load_into_model, save_checkpoint
from pipeline.saving.checkpoints import save_model_checkpoint
from traced_models import build, loss_options, reference


def _train_plain(model: torch.nn.Module, batch, target, steps: int) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(steps):
        reference(model, batch, target, "llama")
        optimizer.step()
    return optimizer


def _worst(a: torch.nn.Module, b: torch.nn.Module) -> float:
    state = b.state_dict()
    return max((value - state[key]).abs().max().item() for key, value in a.state_dict().items())


def _optimizer_worst(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> float:
    worst = 0.0
    for (_, first), (_, second) in zip(sorted(a.state_dict()["state"].items()),
                                       sorted(b.state_dict()["state"].items())):
        for key in ("exp_avg", "exp_avg_sq"):
            worst = max(worst, (first[key] - second[key]).abs().max().item())
    return worst


def test_a_pipeline_checkpoint_loads_into_the_plain_model_and_back(tmp_path: Path) -> None:
    model, batch, target = build("llama")
    plain = copy.deepcopy(model)
    with Pipe(model, chunks=2, sample=batch, devices=["cpu", "cpu"],
              **loss_options("llama")) as pipe:
        optimizer = torch.optim.Adam(pipe.parameters(), lr=0.01)
        for _ in range(2):
            pipe.step(batch, target)
            optimizer.step()
            optimizer.zero_grad()
        save_checkpoint(pipe, optimizer, tmp_path / "pipe", step=2)
    trained_plain = copy.deepcopy(plain)
    plain_optimizer = _train_plain(trained_plain, batch, target, 2)

    loaded = copy.deepcopy(plain)
    loaded_optimizer = torch.optim.Adam(loaded.parameters(), lr=0.01)
    assert load_into_model(loaded, loaded_optimizer, tmp_path / "pipe") == 2
    assert _worst(loaded, trained_plain) < 1e-10
    assert _optimizer_worst(loaded_optimizer, plain_optimizer) < 1e-10
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight

    save_model_checkpoint(loaded, loaded_optimizer, tmp_path / "plain", step=5)
    again = copy.deepcopy(plain)
    with Pipe(again, chunks=2, balance=[4, 2], sample=batch, devices=["cpu", "cpu"],
              **loss_options("llama")) as pipe:
        optimizer = torch.optim.Adam(pipe.parameters(), lr=0.01)
        assert load_checkpoint(pipe, optimizer, tmp_path / "plain") == 5
        assert _worst(again, trained_plain) < 1e-10
        assert again.lm_head.weight is again.model.embed_tokens.weight
        # training goes on exactly as the plain model's would
        pipe.step(batch, target)
        optimizer.step()
    reference(trained_plain, batch, target, "llama")
    plain_optimizer.step()
    assert _worst(again, trained_plain) < 1e-10
