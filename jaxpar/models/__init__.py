"""The decoder in Flax NNX, file for file as torchpar/models/ (tests/core/test_structure.py holds the two lists equal).

decoder.py (both families), layers.py (parameter creation, norms, rotary embedding), llama.py, mla.py (multi-head latent
attention), dilated.py (dilated attention), moe.py (mixture of experts). Logical axes only: no mesh, no parallel/.
"""
