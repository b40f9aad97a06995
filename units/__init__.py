"""Any nn.Module cut into units by tracing (torch.export), under the model's own names.

Imports only torch. ``cut_model(model, sample)`` returns a ``TracedModel`` whose
``sequential`` the pipeline runs like any ``nn.Sequential``.
"""

from units.calls import as_call
from units.errors import TraceError
from units.traced import TracedModel, UnitInfo, cut_model
from units.unit import Unit

__all__ = ["TraceError", "TracedModel", "Unit", "UnitInfo", "as_call", "cut_model"]
