"""Measure a model: F, B, I, W seconds and bytes per layer at a micro-batch size; byte sizes."""
