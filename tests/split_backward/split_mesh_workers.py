"""The split backward on a device mesh, inside spawned gloo ranks (importable by name).

One rank function runs every case in turn (a spawn costs seconds): the mesh GPT of
``mesh_workers`` under a split schedule, sharded by FSDP with its weights resharded
after each forward (W must gather them again) or by tensor parallelism (DTensor
weights), each against the unpipelined model on the union batch.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch

# tests/pipeline's helpers by bare name, as its conftest puts them (a spawned rank starts
# with this process's sys.path; pytest's doctest collection imports this module alone).
HELPERS = str(Path(__file__).resolve().parent.parent / "pipeline" / "helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)

import zoo  # noqa: E402
from examples.gpt import tensor_parallel_plan  # noqa: E402
from mesh_workers import (CHUNKS, balance_for, full_grads, mesh_gpt, mesh_of,  # noqa: E402
                          replica_batch, union_batch, worst)

# name: mesh shape, Distributed.from_mesh options, schedule, Pipe(split_backward=...)
CASES: dict[str, tuple[tuple[int, ...], dict[str, Any], str, str]] = {
    "fsdp resharded zb-h1 layers": ((2, 2), {"data_parallel": "fsdp", "reshard_after_forward": True},
                                    "zb-h1", "layers"),
    "fsdp resharded zb-v layers": ((2, 2), {"data_parallel": "fsdp", "reshard_after_forward": True},
                                   "zb-v", "layers"),
    "fsdp resharded zb-v auto": ((2, 2), {"data_parallel": "fsdp", "reshard_after_forward": True},
                                 "zb-v", "auto"),
    "tensor parallel zb-h1 layers": ((2, 1, 2), {"tensor_parallel": tensor_parallel_plan},
                                     "zb-h1", "layers"),
    "tensor parallel zb-v layers": ((2, 1, 2), {"tensor_parallel": tensor_parallel_plan},
                                    "zb-v", "layers"),
}


def split_on_mesh(rank: int, world: int) -> dict[str, tuple[float, float, int] | str]:
    """Per case: (loss error, gradient error, parameters compared), or the error's text."""
    from pipeline import Distributed, Pipe

    torch.set_num_threads(1)
    found: dict[str, tuple[float, float, int] | str] = {}
    for name, (shape, layout, schedule, path) in CASES.items():
        try:
            mesh = mesh_of(shape)
            model = mesh_gpt()
            expected_loss, expected = zoo.reference_grads(model, *union_batch(mesh), zoo.gpt_loss())
            x, y = replica_batch(mesh)
            trained = copy.deepcopy(model)
            pipe = Pipe(trained, CHUNKS, balance=balance_for(schedule, shape[0]), schedule=schedule,
                        checkpoint="except_last", loss_fn=zoo.gpt_loss(), split_backward=path,
                        distributed=Distributed.from_mesh(mesh, **layout), timeout=60.0)
            loss = float(pipe.step(x, y))
            grads = full_grads(trained)
            found[name] = (abs(loss - expected_loss), worst(grads, expected), len(grads))
            pipe.close()
        except Exception as error:  # noqa: BLE001 - reported per case
            found[name] = zoo.failure_text(error)
    return found
