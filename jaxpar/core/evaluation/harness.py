"""The lm-eval model of a jaxpar or torchpar model: lm-eval's request handling over a framework's `Scorer`.

`ProjectLM` subclasses lm-eval's `TemplateLM`, so the split of a request into context and continuation tokens, the
empty-context rule and the rolling windows of a perplexity request are lm-eval's own. What it adds is what lm-eval's
own `hf` model does with a causal model, so that both give the same numbers on the same weights:
  loglikelihood          (context + continuation)[-(max_length + 1):], the continuation's log-probabilities summed
                         and whether each of its tokens is the model's greedy choice
  loglikelihood_rolling  lm-eval's disjoint windows of max_length tokens, each scored as above, summed per request
  generate_until         the context cut from the left to max_length - max_gen_toks tokens, max_gen_toks tokens
                         decoded with the framework's KV cache, the text cut at the first stop sequence (the
                         end-of-document token's text is always one)
Requests are scored, and prompts decoded, in batches of like length, the longest first.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Protocol

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from jaxpar.core.data.tokens import eod_token, text_codec
from jaxpar.core.errors import UserError

DEFAULT_GEN_TOKENS = 256  # lm-eval's own default max_gen_toks


class Scorer(Protocol):
    """What a framework supplies: its model's log-probabilities and greedy decoding, on whatever devices it runs."""

    max_length: int  # the tokens the model reads at once (model.max_seq_len)

    def log_probs(self, rows: list[list[int]]) -> list[tuple[list[float], list[bool]]]:
        """Per row of tokens t[0..n-1]: log p(t[i+1] | t[..i]) for i < n-1, and whether t[i+1] is the argmax."""

    def generate(
        self, prompts: list[list[int]], new_tokens: int, temperature: float, top_k: int, top_p: float
    ) -> list[list[int]]:
        """The next `new_tokens` tokens of each prompt (of any lengths); temperature 0 is greedy."""


class ProjectLM(TemplateLM):
    """An lm-eval model over a `Scorer`, with the run's tokenizer (byte-level or a tokenizer.json)."""

    def __init__(self, scorer: Scorer, tokenizer: str, batch_size: int = 8):
        super().__init__()
        self.scorer, self.batch_size = scorer, batch_size
        self._encode, self._decode = text_codec(tokenizer)
        self._eot = eod_token(tokenizer)
        self.rolling = defaultdict(lambda: [0.0, 0])  # task -> [log-likelihood, tokens] of its rolling requests

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self._encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self._decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        rows, counts = [], []
        for (context, _), context_enc, continuation_enc in requests:
            if not continuation_enc:
                raise UserError(f"a request's continuation is empty (context {context[:40]!r}...): nothing to score")
            if len(continuation_enc) > self.max_length:
                raise UserError(
                    f"a continuation of {len(continuation_enc)} tokens is longer than the model's max_seq_len "
                    f"{self.max_length} (context {context[:40]!r}...): the model cannot score it"
                )
            rows.append((context_enc + continuation_enc)[-(self.max_length + 1) :])
            counts.append(len(continuation_enc))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))  # like lengths together, the longest first
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            for i, (logp, greedy) in zip(batch, self.scorer.log_probs([rows[i] for i in batch])):
                n = counts[i]
                out[i] = (float(sum(logp[-n:])), bool(all(greedy[-n:])))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for k, req in enumerate(requests):
            tokens = self.tok_encode(req.args[0])
            for ctx, pred in map(
                make_disjoint_window, get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1)
            ):
                windows.append((("", ""), ctx, pred))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (logp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[k] += logp
        # the token counts: each request once (lm-eval evens out the ranks' shares with repeats of a request)
        for req, total in {id(req): (req, total) for req, total in zip(requests, totals)}.values():
            self.rolling[req.task_name][0] += total
            self.rolling[req.task_name][1] += len(self.tok_encode(req.args[0]))
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        jobs = defaultdict(list)  # (new tokens, sampling) -> [(request index, prompt, stops)]
        eos = self.tok_decode([self.eot_token_id])
        for k, req in enumerate(requests):
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs or {}), DEFAULT_GEN_TOKENS)  # lm-eval's reading of them
            stops = handle_stop_sequences(kwargs.pop("until", None), eos=eos or None)
            new, sampling = kwargs.pop("max_gen_toks"), _sampling(kwargs)
            if new >= self.max_length:
                raise UserError(
                    f"max_gen_toks {new} leaves no context in the model's max_seq_len {self.max_length}: "
                    "set a smaller max_gen_toks in the task's generation_kwargs (or --gen-kwargs max_gen_toks=N)"
                )
            prompt = self.tok_encode(context)[-(self.max_length - new) :] or [self.prefix_token_id]
            jobs[(new, sampling)].append((k, prompt, stops))
        out = [""] * len(requests)
        for (new, sampling), group in jobs.items():
            group.sort(key=lambda job: -len(job[1]))  # like lengths together, the longest first
            for start in range(0, len(group), self.batch_size):
                batch = group[start : start + self.batch_size]
                for (k, _, stops), tokens in zip(batch, self.scorer.generate([p for _, p, _ in batch], new, *sampling)):
                    if self.eot_token_id in tokens:  # generation ends there, as transformers' stops at eos
                        tokens = tokens[: tokens.index(self.eot_token_id)]
                    out[k] = postprocess_generated_text(self.tok_decode(tokens), stops, None)
        return out


SAMPLING = ("do_sample", "temperature", "top_k", "top_p")


def _sampling(kwargs: dict) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) of a request's normalized generation settings; 0 is greedy.

    A setting the decoders do not have (repetition_penalty, num_beams, ...) is refused in one line.
    """
    other = sorted(set(kwargs) - set(SAMPLING))
    if other:
        raise UserError(
            f"generation setting(s) {', '.join(other)} are not supported by the project's decoders "
            f"(they take {', '.join(SAMPLING)} and max_gen_toks)"
        )
    if not kwargs.get("do_sample"):
        return 0.0, 0, 1.0
    return float(kwargs.get("temperature", 1.0)), int(kwargs.get("top_k") or 0), float(kwargs.get("top_p") or 1.0)
