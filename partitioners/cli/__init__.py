"""The ``pipe-balance`` command: load a model factory, profile it, print and save a cut or a plan."""
