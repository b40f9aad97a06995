"""Where to cut: profile a model's layers and choose balanced pipeline stages.

Four rooms by phase, each importing only the rooms below it (``tests/test_imports.py``):
``cli`` (the ``pipe-balance`` command) > ``plan`` (the whole plan, searched by simulation)
> ``cut`` (stages from measured layers) > ``measure`` (a model's layers timed and sized).
"""

from partitioners.cut.balance import balance, uniform
from partitioners.cut.memory import held_microbatches, stage_memory
from partitioners.errors import MemoryLimitError
from partitioners.measure.cost import LayerCost, LossCost, Profile
from partitioners.measure.profile import profile
from partitioners.plan.model import plan_for_model
from partitioners.plan.search import Candidate, Plan, plan

__all__ = [
    "Candidate",
    "Plan",
    "plan",
    "plan_for_model",
    "LayerCost",
    "LossCost",
    "MemoryLimitError",
    "Profile",
    "balance",
    "held_microbatches",
    "profile",
    "stage_memory",
    "uniform",
]
