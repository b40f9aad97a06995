"""Pipe.predict prices the split backward the runtime runs: what I keeps for W under each path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline import Pipe
from pipeline.compute.microbatch import split_batch
from pipeline.predict.step import predict_step


@pytest.mark.parametrize("path", ["graph", "layers", "auto"])
def test_the_first_chunk_keeps_for_w_what_its_split_keeps(path: str) -> None:
    """The first chunk's input needs no gradient. Its Linear keeps for W its input and its
    output's gradient (4 rows x (16 + 32) float32) on every path: deferring its weight
    gradient (``"layers"``; ``"auto"``, where nothing in the chunk is larger), or by the
    graph split, which stops at the lowest product (it kept the whole graph before)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Linear(32, 8))
    x, y = torch.randn(16, 16), torch.randn(16, 8)
    with Pipe(model, chunks=4, balance=[2, 2], devices=["cpu", "cpu"], schedule="zb-h1",
              loss_fn=nn.MSELoss(), split_backward=path) as pipe:
        prediction = predict_step(pipe._runner, *split_batch(x, y, 4, True))
    assert prediction.chunks[0].weight_bytes == 4 * (16 + 32) * 4
