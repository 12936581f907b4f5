"""jaxpar: Decoder training on a named-axis JAX mesh (dp, fsdp, tp, pp, sp).

Importing the package imports nothing heavy. `jaxpar.core` is the jax-free shared core that
torchpar reads too; the layers above it are described in docs/architecture.md.
"""
