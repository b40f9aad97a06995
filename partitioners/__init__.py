"""Where to cut: profile a model's layers and choose balanced pipeline stages."""

from partitioners.balance import balance, uniform
from partitioners.cost import LayerCost, LossCost, Profile
from partitioners.errors import MemoryLimitError
from partitioners.memory import held_microbatches, stage_memory
from partitioners.plan import Candidate, Plan, plan
from partitioners.plan_model import plan_for_model
from partitioners.profile import profile

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
