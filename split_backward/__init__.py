"""The split backward of a zero-bubble schedule: I (input gradients) now, W (weight gradients) later.

A leaf package (it imports only torch), used by ``pipeline.compute`` in every I and
W and by ``partitioners`` to time I and W as the runtime runs them.
``graph_split.backward_input`` splits any autograd graph exactly, by reading it
(``autograd_graph``, ``weight_rules``).
"""

from split_backward.graph_split import WeightGradients, backward_input

__all__ = ["WeightGradients", "backward_input"]
