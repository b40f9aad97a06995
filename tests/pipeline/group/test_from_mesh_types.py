"""Distributed.from_mesh refuses what is not a DeviceMesh with a TypeError saying what it
expected and what it got (it was a raw AttributeError on ``mesh_dim_names``)."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline import Distributed


@pytest.mark.parametrize("given, shown", [(object(), "object"), (None, "NoneType"),
                                          ((2, 2), "tuple")])
def test_from_mesh_refuses_what_is_not_a_device_mesh(given: Any, shown: str) -> None:
    with pytest.raises(TypeError, match=f"expected a torch.distributed.device_mesh.DeviceMesh.*got {shown}"):
        Distributed.from_mesh(given)
