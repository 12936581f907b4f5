"""The checks across config keys (jaxpar/core/config/schema.py runs them on every load): one line naming the keys."""

from __future__ import annotations

import dataclasses
import difflib

from jaxpar.core.errors import UserError
from jaxpar.core.data.batch_shapes import bucket_shapes
from jaxpar.core.data.rampup import parse_rampup


def profile_window(spec: str) -> tuple[int, int] | None:
    """train.profile_steps "a:b" -> (a, b): trace steps a..b-1; empty -> None."""
    if not spec:
        return None
    a, colon, b = spec.partition(":")
    if not (colon and a.strip().isdigit() and b.strip().isdigit() and int(a) < int(b)):
        raise UserError(f"config key train.profile_steps: {spec!r} is not of the form a:b with a < b")
    return int(a), int(b)


def did_you_mean(dotted: str, schema) -> str:
    """'; did you mean optim.lr?' for an unknown key of the config class `schema`.

    The known key whose name is closest (optim.lrr, train.lr, optm.lr; at a tie, in the section spelt most like
    it's), else the closest section (optm.nonsense); '' where nothing is close (difflib's ratio under 0.6).
    """
    section, _, name = dotted.partition(".")
    ratio = lambda a, b: difflib.SequenceMatcher(None, a, b).ratio()
    sections = [s.name for s in dataclasses.fields(schema)]
    (close, _), key = max(
        ((ratio(name, f.name), ratio(section, s.name)), f"{s.name}.{f.name}")
        for s in dataclasses.fields(schema)
        for f in dataclasses.fields(s.default_factory())
    )
    if close >= 0.6:
        return f"; did you mean {key}?"
    near = [] if section in sections else difflib.get_close_matches(section, sections, n=1)
    return f"; did you mean {near[0]}?" if near else ""


def int_list(key: str, text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers (model.segment_lengths) -> a tuple."""
    try:
        values = tuple(int(v) for v in text.replace(" ", "").split(",") if v)
    except ValueError:
        raise UserError(f"config key {key}: {text!r} is not a comma-separated list of integers") from None
    if any(v < 1 for v in values):
        raise UserError(f"config key {key}: {text!r} has a value < 1")
    return values


def check_consistency(cfg) -> None:
    m, t = cfg.model, cfg.train
    profile_window(t.profile_steps)
    if not t.eval_tasks:
        for key, unset in (("eval_tasks_every", 0), ("eval_tasks_limit", 0), ("eval_tasks_fewshot", -1)):
            if getattr(t, key) != unset:
                raise UserError(f"train.{key}={getattr(t, key)} has no effect without train.eval_tasks (the tasks)")
    if m.d_model % m.n_head and not m.head_dim:
        raise UserError(
            f"model.d_model={m.d_model} is not divisible by model.n_head={m.n_head} (or set model.head_dim)"
        )
    if cfg.data.seq_len > m.max_seq_len:
        raise UserError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if t.global_batch_size % t.microbatches:
        raise UserError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by train.microbatches={t.microbatches}"
        )
    parse_rampup(t.batch_rampup, t.global_batch_size, t.microbatches)
    if cfg.data.batching == "buckets":
        bucket_shapes(cfg)  # one line for buckets that cannot run
        if t.batch_rampup:
            raise UserError("train.batch_rampup with data.batching=buckets: the buckets set each batch's size")
    if cfg.optim.min_lr > cfg.optim.lr:
        raise UserError(f"optim.min_lr={cfg.optim.min_lr} exceeds optim.lr={cfg.optim.lr}")
    _check_family(m)
    _check_experts(m)
    _check_mtp(m, cfg.data.seq_len)
    _check_loss_scale(cfg)
    if m.attention == "mla" and m.rope_head_dim % 2:
        raise UserError(f"model.rope_head_dim={m.rope_head_dim} must be even (rotary pairs)")
    if m.attention == "dilated":
        _check_dilated(m, cfg.data.seq_len)


def _check_dilated(m, T: int) -> None:
    for w, r in m.dilation_pairs:
        if T % min(w, T) or min(w, T) % r:
            raise UserError(
                f"model.segment_lengths/dilation_rates pair ({w}, {r}): data.seq_len={T} must be "
                f"divisible by the segment length min({w}, {T}), and that by the rate {r}"
            )
        if 0 < m.sparsity_ratio < 1 and min(w, T) // r % m.sparsity_block:
            raise UserError(
                f"model.sparsity_block={m.sparsity_block} does not divide the {min(w, T) // r} tokens a "
                f"head selects in a segment of the pair ({w}, {r}) (min({w}, data.seq_len={T}) / {r})"
            )
    if 1 not in dict(m.dilation_pairs).values():
        raise UserError("model.dilation_rates needs a rate of 1 (otherwise some tokens attend to nothing)")


def _check_mtp(m, seq_len: int) -> None:
    """Multi-token prediction: depth d predicts token t+1+d, so a row needs more than mtp_depth positions."""
    if m.mtp_depth >= seq_len:
        raise UserError(
            f"model.mtp_depth={m.mtp_depth} leaves no target in a row of data.seq_len={seq_len} (depth d "
            "predicts the token d+1 ahead)"
        )
    if m.mtp_depth and m.linear == "sketched":
        raise UserError(
            "model.mtp_depth with model.linear=sketched is not built (the sketches are the main "
            "layers'; the prediction modules' blocks are dense)"
        )


def _set_keys(section, keys) -> list[str]:
    """The keys of a config section set away from their defaults (a setting a mode would ignore is refused)."""
    defaults = type(section)()
    return [k for k in keys if getattr(section, k) != getattr(defaults, k)]


def _check_loss_scale(cfg) -> None:
    o = cfg.optim
    if cfg.model.compute_dtype != "float16":
        for key in _set_keys(o, [f.name for f in dataclasses.fields(o) if f.name.startswith("loss_scale_")]):
            raise UserError(
                f"optim.{key} applies to model.compute_dtype=float16 only (bfloat16 and float32 need no loss scaling)"
            )
    if o.loss_scale_min > o.loss_scale_init:
        raise UserError(f"optim.loss_scale_min={o.loss_scale_min} exceeds optim.loss_scale_init={o.loss_scale_init}")


def _check_experts(m) -> None:
    if m.moe_experts and m.moe_top_k > m.moe_experts:
        raise UserError(f"model.moe_top_k={m.moe_top_k} exceeds model.moe_experts={m.moe_experts}")
    if m.moe_experts and m.linear == "sketched":
        raise UserError("model.linear=sketched sketches the dense MLP; with model.moe_experts the experts replace it")
    if m.moe_experts and m.moe_first_dense >= m.n_layer:
        raise UserError(
            f"model.moe_first_dense={m.moe_first_dense} leaves no layer of model.n_layer={m.n_layer} to "
            "the experts (set model.moe_experts=0 for a dense model)"
        )
    _check_groups(m)


def _check_groups(m) -> None:
    """DeepSeek-V3's group-limited routing: groups of equal size, each scored by its best two experts."""
    if m.moe_topk_group > m.moe_n_group:
        raise UserError(f"model.moe_topk_group={m.moe_topk_group} exceeds model.moe_n_group={m.moe_n_group}")
    if m.moe_n_group == 1 or not m.moe_experts:
        return
    if m.moe_experts % m.moe_n_group:
        raise UserError(f"model.moe_n_group={m.moe_n_group} does not divide model.moe_experts={m.moe_experts}")
    size = m.moe_experts // m.moe_n_group
    if size < 2:
        raise UserError(
            f"model.moe_n_group={m.moe_n_group} leaves one expert per group; a group is scored by its "
            "best two experts (DeepSeek-V3), so each needs two or more"
        )
    if m.moe_top_k > m.moe_topk_group * size:
        raise UserError(
            f"model.moe_top_k={m.moe_top_k} exceeds the {m.moe_topk_group * size} experts of the "
            f"model.moe_topk_group={m.moe_topk_group} groups kept ({size} experts each)"
        )


def _check_family(m) -> None:
    """Keys of the other family are refused when set, never ignored."""
    if m.n_head % m.kv_heads:
        raise UserError(f"model.n_kv_head={m.n_kv_head} must divide model.n_head={m.n_head}")
    if m.family == "gpt2":
        for key in _set_keys(m, ("n_kv_head", "ffn_multiple_of", "tie_embeddings")):
            if not (key == "n_kv_head" and m.n_kv_head == m.n_head):
                raise UserError(
                    f"model.{key} applies to model.family=llama only (GPT-2 has one key/value head per "
                    "query head, a 4*d_model MLP unless model.d_ff is set, and a tied head)"
                )
        return
    if m.linear == "sketched":
        raise UserError(
            "model.linear=sketched is a GPT-2-family variant; model.family=llama supports model.linear=dense"
        )
    if m.head_width % 2 and m.attention != "mla":  # mla rotates its own rope_head_dim features
        raise UserError(
            f"model.family=llama needs an even head dimension for rotary pairs (model.head_dim or d_model/n_head = "
            f"{m.head_width})"
        )
