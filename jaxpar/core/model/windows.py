"""Which layers slide: model.sliding_window and model.full_attention_every, one attention window per layer.

Every layer attends within model.sliding_window keys (0: the whole causal context) unless model.full_attention_every
is N > 0: then layers N-1, 2N-1, ... (every N-th, counting from 1) attend to the whole context and the others slide,
gpt-oss's alternation at N=2 (Hugging Face's layer_types) and Gemma's five-to-one at N=6. Both frameworks' models
and decoders ask `layer_window` for a layer's band; jaxpar's layer scan runs a cycle of N layers per step so that
each keeps a static window (`window_cycle`).
"""

from __future__ import annotations

from jaxpar.core.errors import UserError


def layer_window(m, layer: int) -> int:
    """Layer `layer`'s window (0-based over the whole model, dense first layers included); 0: full attention."""
    return window_at(layer, m.sliding_window, m.full_attention_every)


def window_at(layer: int, window: int, every: int) -> int:
    """layer_window of model.sliding_window = `window` and model.full_attention_every = `every`."""
    if every == 1:
        raise UserError(
            "model.full_attention_every=1 makes every layer full: set model.sliding_window=0 instead (or N >= 2)"
        )
    return 0 if every and (layer + 1) % every == 0 else window


def window_cycle(m) -> tuple[int, ...]:
    """The windows of one period of layers from a layer 0 of the period: (sliding_window,) when every layer is alike."""
    return tuple(layer_window(m, i) for i in range(m.full_attention_every or 1))


def mean_keys(m, seq_len: int) -> float:
    """The keys a query of a full row reads, averaged over the layers: min(T, window) on a sliding layer, T else."""
    windows = [layer_window(m, i) for i in range(m.n_layer)]
    return sum(min(seq_len, w or seq_len) for w in windows) / m.n_layer
