"""Saving: distributed checkpoints that reshard (``checkpoints``: the functions users call),
their format, manifest, bounds, targets and DCP steps, and the rank-0 state dict
(``state_dict``). It takes a Pipe and sits above it: nothing the Pipe runs imports it (the
bounded gather of state stays a collective of ``group``)."""
