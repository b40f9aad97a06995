"""Cut measured layers into stages: the exact min-max cut, stage memory, what a cut means."""
