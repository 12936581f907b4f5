"""Write docs/configuration.md, the configuration reference, from the schema and the key contract.

Every key of the sections in jaxpar/core/config/schema.py, with its type, its default, the values the schema accepts
(its own choices and bounds), what it does (the comments beside the field in config.py) and who acts on it (its
row in jaxpar/core/config/contract.py: the trainers, the torchpar backends, the mode it needs).

    python -m jaxpar.tools.config_reference            print the page
    python -m jaxpar.tools.config_reference --write    write docs/configuration.md
    python -m jaxpar.tools.config_reference --check    exit 1 if docs/configuration.md is out of date

tests/core/test_config_reference.py makes the --check comparison, so a key added without regenerating fails it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import os
import re
import sys
import textwrap
import tokenize

from jaxpar.core.config import schema as config_module
from jaxpar.core.config.schema import REMOVED, Config
from jaxpar.core.config.contract import BACKENDS, CONTRACT, Owner
from jaxpar.core.errors import cli

PAGE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "configuration.md"
)
WIDTH = 118

# What a key does, for the keys that have no comment beside them in config.py. A comment there wins: a key listed
# here that gains one must leave this table (tests/core/test_config_reference.py checks both ways).
NOTES = {
    "model.vocab_size": "tokens in the vocabulary: the embedding's rows (256 for the byte tokenizer).",
    "model.n_layer": "transformer blocks.",
    "model.n_head": "attention heads; tp must divide them.",
    "model.d_model": "the width of the residual stream.",
    "model.max_seq_len": "the longest context the model takes (gpt2: its learned positions).",
    "model.init_std": "the standard deviation of the random initial weights.",
    "model.linear": "the MLP's linear layers: dense, or sketched (a fixed random sketch times a trained factor; "
    "model.sketch*).",
    "model.kv_latent_dim": "mla: the width of the key/value latent.",
    "model.rope_head_dim": "mla: the width of each head's decoupled rotary part.",
    "model.rope_theta": "the base of the rotary position frequencies (llama, mla).",
    "model.dilation_rates": "dilated: the rate of each segment length in model.segment_lengths, comma-separated.",
    "model.sparsity_block": "block-sparse dilated attention: tokens per block.",
    "model.sparsity_seed": "block-sparse dilated attention: the seed that draws each query block's past key blocks.",
    "model.sketch_ratio": "sketched: the sketch's width as a share of the layer's input width.",
    "model.sketch_seed": "sketched: the seed of the fixed random sketch.",
    "model.moe_top_k": "experts each token is sent to.",
    "model.moe_d_ff": "the width of each expert; 0: the MLP's width.",
    "model.moe_topk_group": "group-limited routing: the best groups whose experts a token may choose "
    "(model.moe_n_group).",
    "model.mtp_loss_weight": "the weight of the multi-token prediction loss (model.mtp_depth).",
    "data.seq_len": "tokens per training row.",
    "data.val_fraction": "the share of the token file held out for evaluation.",
    "train.global_batch_size": "rows per optimizer step, over all devices and microbatches.",
    "train.seed": "the seed of the initial weights and of the data order.",
    "train.log_every": "steps between metrics records (metrics.jsonl, the console).",
    "train.eval_batches": "validation batches per evaluation.",
    "train.matmul_precision": "float32 matmul precision (jax's default_matmul_precision; torch's "
    "set_float32_matmul_precision).",
    "optim.lr": "the peak learning rate, reached after the warmup.",
    "optim.min_lr": "the learning rate at the end of the cosine decay.",
    "optim.warmup_steps": "steps of linear warmup from 0 to optim.lr.",
    "optim.beta1": "Adam's first-moment decay.",
    "optim.beta2": "Adam's second-moment decay.",
    "optim.eps": "Adam's epsilon.",
    "optim.weight_decay": "AdamW's decoupled weight decay (not on biases and norms).",
    "optim.muon_ns_steps": "optim.name=muon: Newton-Schulz iterations per step (float32).",
    "optim.muon_lr_rule": "optim.name=muon: how each matrix's step is scaled from optim.lr (see optim.muon_momentum).",
    "optim.loss_scale_growth_interval": "float16: clean steps in a row before the loss scale grows.",
    "optim.loss_scale_growth_factor": "float16: what the loss scale is multiplied by when it grows.",
    "optim.loss_scale_backoff_factor": "float16: what the loss scale is multiplied by after an overflow.",
    "optim.loss_scale_min": "float16: the loss scale never backs off below this; an overflow there stops the run.",
    "parallel.zero_stage": "ZeRO over dp: 0 replicates parameters and optimizer state, 1 shards the optimizer "
    "state, 2 also reduce-scatters the gradients to that layout, 3 shards the parameters "
    "too.",
    "parallel.sequence_zigzag": "sp: deal the sequence's chunks out in zig-zag order, so causal attention's work "
    "is even over the devices.",
    "parallel.pipeline_virtual_stages": "interleaved schedule: model chunks per pipeline device.",
    "parallel.powersgd_rank": "powersgd: the rank of the gradient factors.",
    "parallel.powersgd_warmup_steps": "powersgd: the first steps reduce plainly, without compression.",
    "checkpoint.keep": "the latest checkpoints kept on disk.",
    "checkpoint.resume": "resume from run.dir's latest checkpoint; false moves a run already there aside to "
    "<run.dir>.prev-<k> and starts anew.",
    "run.wandb": "log to Weights & Biases (offline or online), where the wandb package is installed.",
}

SECTIONS = {
    "model": "The network: its family, shape, precision, variants, experts.",
    "data": "The token file, its tokenizer and how rows are cut from it.",
    "train": "The loop: steps, batch, logging, evaluation, sampling, compilation.",
    "optim": "The optimizer and its learning-rate schedule (warmup, then cosine).",
    "parallel": "How the work is split over devices (jaxpar's mesh; torchpar's backends read some of these).",
    "checkpoint": "Saving and resuming.",
    "run": "The run directory, multi-process behaviour, logs and trackers.",
}

HEADER = """\
# Configuration reference

Generated by `python -m jaxpar.tools.config_reference --write` from the schema \
(jaxpar/core/config/schema.py) and the key
contract (jaxpar/core/config/contract.py). Do not edit it by hand; \
`tests/core/test_config_reference.py` fails when it is
out of date.

A config is a YAML file with one mapping per section (`configs/*.yaml`), then `section.key=value` overrides on the
command line. `python -m jaxpar.core.config.schema configs/gpt2-tiny.yaml train.steps=10` prints the resolved config. An
unknown key, a wrong type, a value that is not finite, outside its range or not among its choices is refused in one
line. So is a key set away from its default that the run at hand would not act on: each key below says which
trainers and torchpar backends act on it, and in which mode. A run writes its resolved config to
`<run.dir>/config.json`; `--config <run.dir>/config.json` reads it back.

Sections:
{links}.
"""


def sections(config_cls=Config) -> dict[str, type]:
    """{section name: its dataclass}, in the schema's order."""
    return {f.name: type(getattr(config_cls(), f.name)) for f in dataclasses.fields(config_cls)}


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """{(class name, field name): the comment lines right above the field and the comment on its own lines}."""
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    lines = source.splitlines()
    found = {}
    for cls in (node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)):
        for stmt in (s for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)):
            above, line = [], stmt.lineno - 1
            while line >= 1 and lines[line - 1].lstrip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            beside = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
            text = " ".join(above + beside)
            if text:
                found[(cls.name, stmt.target.id)] = text
    return found


def allowed(meta: dict) -> str:
    """The values the schema accepts, from the field's checks (config.py `_check`): choices or a range."""
    if meta.get("choices") is not None:
        return "one of " + ", ".join(f"`{c}`" for c in meta["choices"])
    lo, hi = meta.get("lo"), meta.get("hi")
    low = f"{'>' if meta.get('lo_open') else '>='} {lo}" if lo is not None else ""
    high = f"<= {hi}" if hi is not None else ""
    return " and ".join(filter(None, (low, high)))


def shown(value) -> str:
    """A default as a user writes it in YAML or an override."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return '""' if value == "" else str(value)


def acted_on(owner: Owner) -> str:
    """Who acts on a key, from its contract row."""
    torch = (
        "torchpar (every backend)"
        if set(owner.torchpar) == set(BACKENDS)
        else f"torchpar --backend {', '.join(owner.torchpar)}"
        if owner.torchpar
        else ""
    )
    who = " and ".join(filter(None, ("jaxpar" if owner.jaxpar else "", torch))) + ("" if torch else " only")
    text = f"Acted on by {who}."
    text += f" Only with {owner.mode}." if owner.mode else ""
    return text + (f" Elsewhere it is refused: {owner.why_not}." if owner.why_not else "")


def describe(key: str, comments: dict, cls_name: str, name: str) -> str:
    """What a key does: its comment in config.py, else its NOTES line; '' when neither says."""
    return comments.get((cls_name, name)) or NOTES.get(key, "")


def markdown_text(text: str) -> str:
    """Plain text as Markdown shows it.

    Outside code spans, a `<` that would open an HTML tag and a `*` that could be emphasis are escaped.
    """

    def escape(part: str) -> str:
        return re.sub(r"(?<! )\*|\*(?! )", r"\\*", re.sub(r"<(?=[A-Za-z/])", r"\\<", part))

    return "".join(p if p.startswith("`") else escape(p) for p in re.split(r"(`[^`]*`)", text))


def entry(key: str, f: dataclasses.Field, default, text: str, owner: Owner | None) -> str:
    """One key's bullet: type, default, accepted values, description, who acts on it."""
    head = f"`{f.type if isinstance(f.type, str) else f.type.__name__}`, default `{shown(default)}`"
    accepts = allowed(dict(f.metadata))
    head += f", {accepts}" if accepts else ""
    body = f"**`{key}`** ({head}): {markdown_text(text)}" if text else f"**`{key}`** ({head})."
    body += "" if body.endswith(".") else "."
    body += " " + markdown_text(acted_on(owner) if owner else "No contract row.")
    lines = textwrap.wrap(body, WIDTH - 2, break_on_hyphens=False, break_long_words=False)
    if any(re.match(r"([-+*#>|]|\d+[.)])(\s|$)", line) for line in lines[1:]):  # would start a list, a heading...
        lines = [body]
    return "- " + "\n  ".join(lines)


def render(config_cls=Config, contract: dict | None = None, source: str | None = None) -> str:
    """The whole page (the arguments are for tests: another schema, contract or config.py source)."""
    contract = CONTRACT if contract is None else contract
    comments = field_comments(inspect.getsource(config_module) if source is None else source)
    parts = [HEADER.format(links=",\n".join(f"[{s}](#{s})" for s in sections(config_cls)))]
    for section, cls in sections(config_cls).items():
        parts.append(f"## {section}\n\n{SECTIONS.get(section, '')}".rstrip() + "\n")
        defaults = cls()
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            text = describe(key, comments, cls.__name__, f.name)
            parts.append(entry(key, f, getattr(defaults, f.name), text, contract.get(key)))
        parts.append("")
    parts.append(
        "## Removed keys\n\nKeys that earlier versions took; a run's old config.json holding one at its "
        '"off" value still loads.\n'
    )
    parts += [f"- `{key}`: {why}." for key, (_, why) in REMOVED.items()]
    return "\n".join(parts) + "\n"


@cli
def main(argv=None) -> int:
    """Print, write or check docs/configuration.md."""
    p = argparse.ArgumentParser(
        prog="python -m jaxpar.tools.config_reference",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true", help="write docs/configuration.md")
    what.add_argument("--check", action="store_true", help="exit 1 if the page differs from the schema's")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    page = render()
    if args.write:
        with open(PAGE, "w", encoding="utf-8") as f:
            f.write(page)
    elif args.check:
        with open(PAGE, encoding="utf-8") as f:
            if f.read() != page:
                print(f"{PAGE} is out of date: run python -m jaxpar.tools.config_reference --write", file=sys.stderr)
                return 1
    else:
        print(page, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
