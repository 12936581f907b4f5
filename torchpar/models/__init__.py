"""The decoder in PyTorch, file for file as jaxpar/models/ (tests/core/test_structure.py holds the two lists equal).

decoder.py (both families), layers.py (parameter holders, norms, rotary embedding, sketched linear), llama.py, mla.py
(multi-head latent attention), dilated.py (dilated attention), moe.py (mixture of experts). No parallelism: the backends
wrap it.
"""
