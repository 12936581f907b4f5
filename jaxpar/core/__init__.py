"""The shared core: what jaxpar and torchpar both read. Imports neither jax nor torch (a test checks).

Config schema, errors, learning-rate schedule, FLOP and parameter counts by formula, pipeline
schedule tables, token files and the data order, the weight-name table, the training-loop skeleton.
"""
