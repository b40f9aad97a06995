"""Any nn.Module as the pipeline runs it: a ``Cut`` of units under the model's own names.

Imports only torch. ``Cut.of_sequential(model)`` is a Sequential's trivial cut (its layers
are the units); ``cut_model(model, sample)`` traces any other module (torch.export) and
cuts it into units that hold the model's own modules at their paths.
"""

from units.calls import as_call
from units.cut import Cut, UnitInfo
from units.errors import TraceError
from units.traced import TracedCut, cut_model
from units.unit import Unit

__all__ = ["Cut", "TraceError", "TracedCut", "Unit", "UnitInfo", "as_call", "cut_model"]
