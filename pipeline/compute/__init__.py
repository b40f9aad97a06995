"""One model chunk's work on its device: forward, backward, I and W, recomputation, losses, activations."""
