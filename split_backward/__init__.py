"""The split backward of a zero-bubble schedule: I (input gradients) now, W (weight gradients) later.

A leaf package (it imports only torch), used by ``pipeline.compute`` in every I and
W and by ``partitioners`` to time I and W as the runtime runs them. Two ways, chosen
per chunk and micro-batch (``chunk_split.ChunkSplit``): layers that defer their own
weight gradients (``switched_layers``: Linear, MultiheadAttention, convolutions, by
``deferred_linear`` and ``deferred_conv``), and the exact split of any autograd
graph by reading it (``graph_split``, ``autograd_graph``, ``weight_rules``), for
everything the layers do not cover; on a first stage, whose input needs no gradient,
it stops at the lowest products (``first_stage``).
"""

from split_backward.chunk_split import (
    MIN_PRODUCT,
    SPLIT_MODES,
    ChunkSplit,
    SplitMode,
    check_mode,
    trial_split,
)
from split_backward.graph_split import WeightGradients, backward_input

__all__ = ["MIN_PRODUCT", "SPLIT_MODES", "ChunkSplit", "SplitMode", "WeightGradients",
           "backward_input", "check_mode", "trial_split"]
