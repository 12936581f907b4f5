"""The decoder in PyTorch, file for file as jaxpar/models/: decoder.py (both families), llama.py, variants.py (multi-head
latent attention, dilated attention, sketched linear), layers.py. No parallelism: the backends wrap it."""
