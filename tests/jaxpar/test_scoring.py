"""jaxpar's lm-eval scorer (jaxpar/scoring.py) on meshes: a sharded model gives one device's log-likelihoods."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.core.evaluation.harness import ProjectLM
from jaxpar.layout import Layout
from jaxpar.mesh import make_mesh
from jaxpar.models.decoder import abstract_model
from jaxpar.scoring import JaxScorer
from jaxpar.state import init_state
from tests.helpers import EVAL_GEN, EVAL_MC, EVAL_TEXT, tiny_config

FAMILIES = {"gpt2": (), "llama": ("model.family=llama", "model.n_kv_head=2", "model.d_ff=48")}


def answers(cfg, params, sizes: dict) -> tuple:
    """The tiny tasks' log-likelihoods, greedy flags, rolling log-likelihood and generations on the mesh `sizes`."""
    n = int(np.prod(list(sizes.values())))
    layout = Layout(cfg, make_mesh(sizes, jax.devices()[:n]))
    placed = jax.device_put(params, layout.device_shardings["params"])
    lm = ProjectLM(JaxScorer(layout, lambda: placed, batch_size=4), "byte", batch_size=4)
    req = lambda *args: SimpleNamespace(args=args, task_name="t")
    mc = lm.loglikelihood([req(q, c) for q, choices, _ in EVAL_MC for c in choices])
    rolling = lm.loglikelihood_rolling([req(EVAL_TEXT)])
    gen = lm.generate_until([req(p, {"until": ["\n"], "max_gen_toks": 12}) for p in EVAL_GEN[:3]])  # a compile each
    return [x for x, _ in mc], [g for _, g in mc], rolling, gen


@pytest.mark.parametrize("family", [pytest.param("gpt2", marks=pytest.mark.every_commit), "llama"])
def test_sharded_scoring_equals_one_device(family):
    cfg = tiny_config("model.init_std=0.3", *FAMILIES[family])
    params = init_state(Layout(cfg, make_mesh({"dp": 1}, jax.devices()[:1])))["params"]
    one = answers(cfg, params, {"dp": 1})
    assert len(set(one[3])) > 1, one[3]  # large random weights: the generations differ from prompt to prompt
    for sizes in ({"dp": 2, "tp": 2}, {"fsdp": 4}):
        got = answers(cfg, params, sizes)
        np.testing.assert_allclose(got[0], one[0], rtol=0, atol=1e-5, err_msg=str(sizes))
        np.testing.assert_allclose(got[2], one[2], rtol=1e-6, err_msg=str(sizes))
        assert got[1] == one[1] and got[3] == one[3], sizes


def test_scores_are_the_models_own_log_softmax():
    """One row by hand: the model's logits, log-softmax, the target's entry; greedy where it is the argmax."""
    cfg = tiny_config("model.init_std=0.3")
    layout = Layout(cfg, make_mesh({"dp": 1}, jax.devices()[:1]))
    params = init_state(layout)["params"]
    row = list(b"def f(x):\n    return x")
    logits = np.asarray(nnx.merge(abstract_model(cfg.model)[0], params)(np.asarray([row[:-1]])))[0]
    logp = (
        logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1)[:, None]
    )
    want = logp[np.arange(len(row) - 1), row[1:]]
    got, greedy = JaxScorer(layout, lambda: params, batch_size=2).log_probs([row])[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert greedy == list(logits.argmax(-1) == np.asarray(row[1:]))
