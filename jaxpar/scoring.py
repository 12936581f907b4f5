"""The jaxpar model as lm-eval's evaluator reads it: per-token log-probabilities and greedy decoding on a mesh.

`JaxScorer` is the Scorer of jaxpar/core/evaluation/harness.py over a layout's parameters (the eval command's
restored checkpoint, or the training state itself). Rows are padded on the right to a few lengths (powers of two up
to max_seq_len + 1) and to a fixed batch, so a task compiles a handful of programs; a causal model's scores of a row
do not depend on what follows it. The batch is split over the mesh's data axes (dp, fsdp) and the model as the rules
table shards it (tp), so a model larger than one device is evaluated sharded. Decoding is jaxpar/decode.py's KV cache,
prompts of different lengths in one batch (make_generate_ragged: a program per power of two of their lengths), the
batch replicated on every device (the model sharded as for scoring).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from jaxpar.context import use
from jaxpar.core.data.tokens import document_token
from jaxpar.decode import make_generate_ragged
from jaxpar.layout import Layout
from jaxpar.loss import split_rows
from jaxpar.models.decoder import abstract_model
from jaxpar.parallelize import parallel_context
from jaxpar.sharding import spec_for


def _padded_length(n: int, cap: int) -> int:
    return min(cap, max(16, 1 << (n - 1).bit_length()))


def _to_host(x):
    """A global array on every process's host (the eval command is one process; a training run may be several)."""
    return multihost_utils.process_allgather(x, tiled=True) if jax.process_count() > 1 else jax.device_get(x)


class JaxScorer:
    """Log-probabilities and decoding of the parameters `params()` returns, on `layout`'s mesh."""

    def __init__(self, layout: Layout, params: Callable[[], dict], batch_size: int):
        self.layout, self.params = layout, params
        self.max_length = layout.cfg.model.max_seq_len
        ways = int(np.prod([layout.mesh.shape[a] for a in ("dp", "fsdp") if a in layout.mesh.shape]))
        self.rows = -(-batch_size // ways) * ways  # a whole number of rows on each data shard
        graphdef, eod = abstract_model(layout.cfg.model)[0], document_token(layout.cfg)
        self._generate = make_generate_ragged(graphdef, eod)
        context = parallel_context(layout)
        self.sharding = NamedSharding(layout.mesh, spec_for(("batch", None), (self.rows, 1), layout.mesh, layout.rules))

        def score(params, rows):
            with use(context):
                model = nnx.merge(graphdef, params)
                r = split_rows(rows, None, eod)
                logits = model(r.inputs, r.positions, r.segments).astype(jnp.float32)
                logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), r.targets[..., None], -1)[..., 0]
                return logp, jnp.argmax(logits, -1) == r.targets

        self._score = jax.jit(score, in_shardings=(layout.device_shardings["params"], self.sharding))

    def _device_params(self) -> dict:
        return jax.device_put(self.params(), self.layout.device_shardings["params"])  # if the run offloads them

    def log_probs(self, rows: list[list[int]]) -> list[tuple[list[float], list[bool]]]:
        length = _padded_length(max(len(r) for r in rows), self.max_length + 1)
        batch = np.zeros((self.rows, length), np.int32)
        for i, row in enumerate(rows):
            batch[i, : len(row)] = row
        logp, greedy = _to_host(self._score(self._device_params(), jax.device_put(batch, self.sharding)))
        return [(logp[i, : len(r) - 1].tolist(), greedy[i, : len(r) - 1].tolist()) for i, r in enumerate(rows)]

    def generate(
        self, prompts: list[list[int]], new_tokens: int, temperature: float, top_k: int, top_p: float
    ) -> list[list[int]]:
        """Prompts of any lengths: padded on the right to a power of two, the shortest's power of two prefilled."""
        lengths = [len(p) for p in prompts]
        width = min(_padded_length(max(lengths), self.max_length), self.max_length - new_tokens)
        prefill = 1 << (min(lengths).bit_length() - 1)  # at most the shortest prompt
        batch = np.zeros((self.rows, width), np.int32)
        for i, p in enumerate(prompts + [prompts[0]] * (self.rows - len(prompts))):
            batch[i, : len(p)] = p
        rows = np.asarray(lengths + [lengths[0]] * (self.rows - len(prompts)), np.int32)
        with use(parallel_context(self.layout)):
            out = self._generate(
                self._device_params(),
                jnp.asarray(batch),
                jnp.asarray(rows),
                jax.random.key(0),
                prefill=prefill,
                new_tokens=new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
            )
        return _to_host(out)[: len(prompts)].tolist()
