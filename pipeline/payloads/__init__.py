"""What crosses between stages and ranks: pytrees of tensors, their structure and shared values."""
