"""Block-sparse dilated attention (model.sparsity_ratio) in both frameworks.

The pattern is in jaxpar/core/model/layer_rules.py, the cores in models/dilated.py on both sides. Tested: the pattern's
rules; at sparsity 0.25 equal to a dense computation masked to the same blocks (and far from dense dilated attention, so
that ignoring the sparsity fails); torchpar's blocked sum and FlexAttention's block mask equal to jaxpar; decoding's
form; both trainers from one weights file (the model's loss and gradients: tests/jaxpar/test_variants.py's twins); sp=2
equal to one device; the compiled step's attention FLOPs against dense dilated attention's.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxpar.core.model.layer_rules import BlockSparsity, block_sparsity, dense_blocks, kept_blocks, kept_count
from jaxpar.core.errors import UserError
from jaxpar.models import dilated as jd
from tests.helpers import assert_params_close, metrics, run_cli, run_steps, tiny_config
from torchpar.models import dilated as td

PAIRS = ((16, 1), (32, 2), (64, 4))  # on 64 tokens: every pair's selected row holds 16 tokens, 8 blocks of 2
SPARSE = BlockSparsity(0.25, 2, 0)  # 2 of a row's 8 blocks at most: a quarter of the dense scores
# the model: 32 tokens, rows of 16 selected tokens in both pairs (8 blocks of 2)
MODEL = (
    "data.seq_len=32",
    "model.attention=dilated",
    "model.segment_lengths=16,32",
    "model.dilation_rates=1,2",
    "model.sparsity_block=2",
)
SPARSE_MODEL = MODEL + ("model.sparsity_ratio=0.25",)


attention = jax.jit(jd.dilated_attention, static_argnums=(3, 4))  # compiled once, not op by op


def _qkv(shape=(2, 64, 4, 8), seed=0):
    return np.random.default_rng(seed).normal(size=(3,) + shape).astype(np.float32)


def test_pattern_keeps_the_diagonal_and_a_share_of_past_blocks():
    for nb in (1, 4, 8, 13):
        kept = kept_blocks(SPARSE, 64, 4, 4, nb)
        assert kept.shape == (4, nb, kept_count(0.25, nb))
        for h in range(4):
            for i in range(nb):
                row = kept[h, i][kept[h, i] >= 0]
                assert row[0] == i and (row[1:] < i).all() and len(set(row)) == len(row) == kept_count(0.25, i + 1)
    # a longer row (decoding over a longer context) starts with the same blocks
    longer, row = kept_blocks(SPARSE, 64, 4, 4, 16), kept_blocks(SPARSE, 64, 4, 4, 8)
    np.testing.assert_array_equal(longer[:, :8, :2], row)
    assert (longer[:, :8, 2:] == -1).all()
    assert not np.array_equal(kept_blocks(BlockSparsity(0.25, 2, 1), 64, 4, 4, 8), row)  # the seed draws it
    assert block_sparsity(tiny_config(*MODEL).model) is None  # ratio 0 (and 1): dense
    assert block_sparsity(tiny_config(*MODEL, "model.sparsity_ratio=1").model) is None


def _oracle(q, k, v, pairs, sp):
    """Reference attention: dense float64 scores masked to the pairs' selections and the kept blocks.

    Dense [T, T] scores of each head, masked to the pairs' selections and to the kept blocks (a key that c pairs show a
    query enters its one softmax c times), float64.
    """
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    B, T, H, D = q.shape
    t = np.arange(T)
    out = np.zeros_like(q)
    for h in range(H):
        count = np.zeros((T, T))
        for w, r in pairs:
            seg = min(w, T)
            blocks = kept_blocks(sp, w, r, H, seg // r // sp.block)[h]
            allowed = np.zeros((len(blocks), len(blocks)), bool)
            for i, js in enumerate(blocks):
                allowed[i, js[js >= 0]] = True
            chosen, blk = t % seg % r == h % r, t % seg // r // sp.block
            count += (
                (t[:, None] // seg == t[None, :] // seg)
                & (t[None, :] <= t[:, None])
                & chosen[:, None]
                & chosen[None, :]
                & allowed[blk[:, None], blk[None, :]]
            )
        s = np.einsum("bqd,bkd->bqk", q[:, :, h], k[:, :, h]) / np.sqrt(D) + np.log(np.maximum(count, 1))
        s = np.where(count > 0, s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        out[:, :, h] = (a / a.sum(-1, keepdims=True)) @ v[:, :, h]
    return out


def test_sparse_equals_dense_attention_masked_to_the_same_blocks():
    q, k, v = _qkv()
    with jax.default_matmul_precision("highest"):
        got = np.asarray(attention(*map(jnp.asarray, (q, k, v)), PAIRS, SPARSE))
        dense = np.asarray(attention(*map(jnp.asarray, (q, k, v)), PAIRS))
    want = _oracle(q, k, v, PAIRS, SPARSE)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(dense - want).max() > 0.5  # the sparsity shows: dense dilated attention is far from it


def test_torchpar_blocked_and_flex_attention_equal_jaxpar():
    q, k, v = _qkv()
    with jax.default_matmul_precision("highest"):
        want = np.asarray(attention(*map(jnp.asarray, (q, k, v)), PAIRS, SPARSE))
    got = td.dilated_attention(*map(torch.from_numpy, (q, k, v)), PAIRS, SPARSE).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # FlexAttention with the BlockMask built from the same pattern (its CPU form runs forward only, unfused)
    rows = torch.from_numpy(_qkv((2, 2, 16, 4, 8), seed=1))  # [3, B, S, n, H, D]: one pair's selected rows
    kept = kept_blocks(SPARSE, 32, 2, 4, 8)
    blocked = td._blocked_core(*rows, kept)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile()"
        flex = td._flex_core(*rows, kept)
    for a, b in zip(flex, blocked):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)
    # the block lists the fused kernel visits (the CPU's unfused form reads the mask_mod alone): the kept blocks,
    # the diagonal partial (causal), the past ones full
    mask = td.flex_block_mask(kept, 16, "cpu")
    np.testing.assert_array_equal(mask.to_dense()[0].numpy() > 0, dense_blocks(kept))
    full = torch.zeros(4, 8, 8, dtype=torch.bool)
    for h, i in np.ndindex(4, 8):
        full[h, i, mask.full_kv_indices[0, h, i, : mask.full_kv_num_blocks[0, h, i]].long()] = True
    np.testing.assert_array_equal(full.numpy(), dense_blocks(kept) & ~np.eye(8, dtype=bool))


def test_decoding_attends_the_same_blocks():
    """Decoding attends the same blocks as the training forward.

    key_counts (decoding over a cache, both frameworks) with the pattern is the training forward, also over a longer
    context.
    """
    q, k, v = _qkv()
    T, H = q.shape[1], q.shape[2]
    pos = jnp.arange(T)
    key_counts = jax.jit(jd.key_counts, static_argnums=(2, 3, 4, 5))
    counts = key_counts(pos, pos, H, PAIRS, T, SPARSE)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(jax.jit(jd.counted_attention)(*map(jnp.asarray, (q, k, v)), counts))
        want = np.asarray(attention(*map(jnp.asarray, (q, k, v)), PAIRS, SPARSE))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    longer = key_counts(pos, jnp.arange(2 * T), H, PAIRS, 2 * T, SPARSE)[:, :, :T]
    np.testing.assert_array_equal(longer, counts)
    tpos = torch.arange(T)
    np.testing.assert_array_equal(td.key_counts(tpos, tpos, H, PAIRS, T, SPARSE).numpy(), counts)


def test_trainers_agree_from_torchpar_write_init(tmp_path, dataset):
    """torchpar.train --write-init, then both trainers from that file (model.init_from): 3 steps alike."""
    init, args = str(tmp_path / "init.safetensors"), [*SPARSE_MODEL, "train.steps=3", "checkpoint.every=0"]
    torch_run = run_cli(
        tmp_path / "t", dataset, "--backend", "none", "--write-init", init, *args, module="torchpar.train"
    )
    assert torch_run.returncode == 0, torch_run.stderr[-3000:]
    for trainer in ("torchpar.train", "jaxpar.train"):
        extra = ("--backend", "none") if trainer == "torchpar.train" else ()
        r = run_cli(tmp_path / trainer, dataset, *extra, *args, f"model.init_from={init}", module=trainer)
        assert r.returncode == 0, r.stderr[-3000:]
    t, j = metrics(tmp_path / "torchpar.train"), metrics(tmp_path / "jaxpar.train")
    np.testing.assert_allclose([j[s]["loss"] for s in (1, 2, 3)], [t[s]["loss"] for s in (1, 2, 3)], rtol=1e-5)
    np.testing.assert_allclose(
        [j[s]["grad_norm"] for s in (1, 2, 3)], [t[s]["grad_norm"] for s in (1, 2, 3)], rtol=1e-4
    )


@pytest.mark.parametrize("axis", [1, 2], ids=["sequence", "heads"])
def test_sharded_over_sp_equals_one_device(axis):
    """The sequence cut in halves over sp=2 (segments of 32 and 64 span both shards; or the heads, as tp cuts them).

    GSPMD partitions the block gathers; output and input gradients as on one device.
    """
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    q, k, v = map(jnp.asarray, _qkv())
    probe = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32)
    f = jax.jit(jax.value_and_grad(lambda *x: jnp.sum(probe * jd.dilated_attention(*x, PAIRS, SPARSE)), (0, 1, 2)))
    mesh = jax.make_mesh((2,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])  # as jaxpar's
    halves = NamedSharding(mesh, PartitionSpec(*[None] * axis, "sp"))
    with jax.default_matmul_precision("highest"):
        want = f(q, k, v)
        got = f(*(jax.device_put(x, halves) for x in (q, k, v)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_sequence_parallel_equals_one_device(dataset):
    """The model trained 3 steps on sp=2 (each 32-token row in halves: segments of 32 span both shards)."""
    cfg = tiny_config(*SPARSE_MODEL)
    ref = run_steps(cfg, "dp=1", dataset, steps=3, devices=jax.devices()[:1])
    got = run_steps(cfg, "sp=2", dataset, steps=3, devices=jax.devices()[:2])
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    assert_params_close(got["params"], ref["params"])


def test_attention_flops_of_the_step_are_a_quarter_of_dense():
    """The dilated attention's matmuls in the traced (loss, gradients) program.

    2 key blocks of 8 per query block, so 0.25x; an upper bound of 0.35x leaves room for a cheaper first block.
    """
    from jaxpar.cost.jaxpr_flops import matmul_flops
    from jaxpar.cost.loss_and_grad import loss_and_grad_program

    def attention_flops(cfg):
        traced, params, batch = loss_and_grad_program(cfg, {"dp": 1}, jax.devices()[:1])
        return matmul_flops(jax.make_jaxpr(traced)(params, batch).jaxpr, scope="dilated_attention")

    dense, sparse = attention_flops(tiny_config(*MODEL)), attention_flops(tiny_config(*SPARSE_MODEL))
    assert dense > 0 and sparse <= 0.35 * dense, (sparse, dense)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("model.sparsity_block=3",), "model.sparsity_block=3"),  # rows of 16 tokens
        (("model.dilation_rates=1,4", "model.sparsity_block=16"), "pair \\(32, 4\\)"),  # 16 and 8 tokens
    ],
    ids=["block-3", "rate-4-block-16"],
)
def test_blocks_that_do_not_divide_a_row_are_refused(overrides, message):
    with pytest.raises(UserError, match=message):
        tiny_config(*SPARSE_MODEL, *overrides)


def test_sparsity_without_dilated_attention_is_refused():
    from jaxpar.core.config.contract import Run, check_contract

    with pytest.raises(UserError, match="model.sparsity_ratio=0.25 .*model.attention=dilated"):
        check_contract(Run(tiny_config("model.sparsity_ratio=0.25"), "jaxpar"))
