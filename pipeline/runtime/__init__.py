"""What runs every step: the runners (threads, or one stage per rank), the executor, the step's state."""
