"""jaxpar: GPT training on a named-axis JAX mesh (dp, fsdp, tp, pp, sp).

Importing the package imports nothing heavy: `jaxpar.config` is read by torchpar too.
"""
