"""The whole plan: candidates (schedule, micro-batches, cut, recomputation) priced and searched."""
