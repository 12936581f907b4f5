"""jaxpar: Decoder training on a named-axis JAX mesh (dp, fsdp, tp, pp, sp).

Importing the package imports nothing heavy. `jaxpar.core` is the jax-free shared core that
torchpar reads too; the layers above it are described in docs/architecture.md.
"""

from jaxpar import moved as _moved

_moved.install()  # an old module path (before the core's folders) fails with one line naming its new place
