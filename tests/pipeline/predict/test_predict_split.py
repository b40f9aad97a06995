"""Pipe.predict prices the split backward the runtime runs: what I keeps for W under each path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline import Pipe
from pipeline.compute.microbatch import split_batch
from pipeline.predict.step import predict_step


@pytest.mark.parametrize("path", ["graph", "layers"])
def test_the_first_chunk_keeps_for_w_what_its_split_keeps(path: str) -> None:
    """The first chunk's input needs no gradient. Its Linear, deferring its weight gradient
    (``"layers"``), keeps for W its input and its output's gradient (4 rows x (16 + 32)
    float32); the graph split keeps the whole graph (more). The probe measured the graph
    split's bytes on both paths: its chunk had not switched its layers on yet."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Linear(32, 8))
    x, y = torch.randn(16, 16), torch.randn(16, 8)
    with Pipe(model, chunks=4, balance=[2, 2], devices=["cpu", "cpu"], schedule="zb-h1",
              loss_fn=nn.MSELoss(), split_backward=path) as pipe:
        prediction = predict_step(pipe._runner, *split_batch(x, y, 4, True))
    kept = prediction.chunks[0].weight_bytes
    if path == "layers":
        assert kept == 4 * (16 + 32) * 4
    else:
        assert kept > 4 * (16 + 32) * 4
