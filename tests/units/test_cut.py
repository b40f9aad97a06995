"""Every model is a Cut under its own names: a Sequential's trivial cut and a traced model's
answer the state, a stage's view, ties and strict loading in the model's own keys."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from partitioners.measure.model_cut import cut_of
from pipeline import Pipe
from units import Cut, UnitInfo

from traced_models import Looped, llama, looped_batch, mse, tokens


def _tied_sequential() -> nn.Sequential:
    torch.manual_seed(0)
    embed, head = nn.Linear(4, 6, bias=False), nn.Linear(4, 6, bias=False)
    head.weight = embed.weight
    return nn.Sequential(embed, nn.Tanh(), nn.Linear(6, 4), head).double()


def test_a_sequential_is_its_own_trivial_cut() -> None:
    model = _tied_sequential()
    cut = cut_of(model)
    assert type(cut) is Cut and cut.units is model
    assert list(cut.state_dict()) == list(model.state_dict())
    assert cut.ties == (("0.weight", "3.weight"),)
    assert cut.infos[2] == UnitInfo(2, "2", ("2",), ("2.weight", "2.bias"))
    assert set(cut.view([2, 3]).state_dict()) == {"2.weight", "2.bias", "3.weight"}
    assert cut.keys([1]) == frozenset()


def test_a_traced_models_keys_are_its_own_with_no_unit_prefix() -> None:
    model = llama(layers=2)
    batch, _ = tokens()
    cut = cut_of(model, batch)
    assert list(cut.state_dict()) == list(model.state_dict())
    assert cut.ties == (("model.embed_tokens.weight", "lm_head.weight"),)
    # a stage's share: the last unit holds the norm and the head (the embedding, tied)
    last = cut.view([len(cut) - 1]).state_dict()
    assert {"model.norm.weight", "lm_head.weight"} <= set(last)
    assert not any(key[0].isdigit() for key in last)


def test_the_pipes_state_and_loading_use_the_models_keys() -> None:
    model = Looped()
    batch, target = looped_batch()
    plain = copy.deepcopy(model)
    with Pipe(model, chunks=2, sample=batch, devices=["cpu", "cpu"], loss_fn=mse) as pipe:
        assert pipe.cut.units is pipe.model
        assert list(pipe.state_dict()) == list(model.state_dict())
        wrong = dict(plain.state_dict())
        wrong["blocks.9.mix.weight"] = wrong.pop("blocks.1.mix.weight")
        with pytest.raises(ValueError, match=r"missing \['blocks.1.mix.weight'\], "
                                             r"unexpected \['blocks.9.mix.weight'\]"):
            pipe.load_state_dict(wrong)
        for parameter in plain.parameters():
            parameter.data.add_(1.0)
        pipe.load_state_dict(plain.state_dict())
        for (name, mine), theirs in zip(model.state_dict().items(), plain.state_dict().values()):
            assert torch.equal(mine, theirs), name


def test_a_tie_the_state_would_break_is_named_by_the_models_keys() -> None:
    model = llama(layers=2)
    batch, _ = tokens()
    state = {key: value.clone() for key, value in model.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    with Pipe(model, chunks=2, sample=batch, devices=["cpu", "cpu"]) as pipe:
        with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' and "
                                             r"'lm_head.weight' are one parameter"):
            pipe.load_state_dict(state)


def test_pipe_units_describe_a_sequentials_layers_too() -> None:
    model = _tied_sequential()
    with Pipe(model, chunks=2, balance=[3, 1], devices=["cpu", "cpu"]) as pipe:
        assert [(unit.name, unit.stage) for unit in pipe.units] == [
            ("0", 0), ("1", 0), ("2", 0), ("3", 1)]
