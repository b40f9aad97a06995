"""The process group around a pipeline: devices, agreement, bounded collectives, local launch."""
