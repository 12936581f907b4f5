"""Weights on disk: the shared weight names and file, and the training-state file both frameworks convert through."""
