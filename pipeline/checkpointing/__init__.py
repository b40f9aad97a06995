"""Saving and loading checkpoints (``pipeline.checkpoints`` is the façade): the format that
crosses ranks and lands on disk, the manifest of digests, what a rank saves and reads back,
and DCP's steps for one rank without collectives."""
