"""The lm-eval model's request handling (jaxpar/core/evaluation/harness.py) over a scorer whose answers name the tokens.

The fake scorer's log-probability of each target token is minus that token's id, so a request's log-likelihood says
exactly which tokens were summed: a context/continuation split one token off, a lost window or a token scored twice
changes it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxpar.core.errors import UserError
from jaxpar.core.evaluation.harness import ProjectLM
from jaxpar.core.evaluation.results import scores
from jaxpar.core.evaluation.tasks import parse_tasks


class NamingScorer:
    """log p(t[i+1] | t[..i]) = -t[i+1]; greedy where t[i+1] is even; generation repeats a fixed text."""

    def __init__(self, max_length: int, text: bytes = b"abc\ndef"):
        self.max_length, self.text, self.rows, self.prompts = max_length, text, [], []

    def log_probs(self, rows):
        self.rows += rows
        return [([-float(t) for t in r[1:]], [t % 2 == 0 for t in r[1:]]) for r in rows]

    def generate(self, prompts, new_tokens, temperature, top_k, top_p):
        self.prompts.append((prompts, new_tokens, (temperature, top_k, top_p)))
        return [list((self.text * new_tokens)[:new_tokens]) for _ in prompts]


def request(*args, task="t"):
    return SimpleNamespace(args=args, task_name=task)


def test_a_continuation_is_scored_on_its_own_tokens():
    scorer = NamingScorer(max_length=64)
    lm = ProjectLM(scorer, "byte", batch_size=2)
    got = lm.loglikelihood([request("ab", "c"), request("ab ", "cd"), request("", "xy")])
    # "ab " + "cd": lm-eval moves the context's trailing space into the continuation
    assert got == [(-ord("c"), False), (-(ord(" ") + ord("c") + ord("d")), False), (-(ord("x") + ord("y")), False)]
    assert [ord("a"), ord("b"), ord("c")] in scorer.rows
    assert [0, ord("x"), ord("y")] in scorer.rows  # an empty context: the end-of-document token before it


def test_greedy_means_every_continuation_token():
    lm = ProjectLM(NamingScorer(max_length=64), "byte")
    assert lm.loglikelihood([request("a", "bd"), request("a", "bf"), request("a", "bc")]) == [
        (-(98 + 100), True),
        (-(98 + 102), True),
        (-(98 + 99), False),
    ]


def test_a_long_request_keeps_its_last_max_length_plus_one_tokens():
    scorer = NamingScorer(max_length=8)
    lm = ProjectLM(scorer, "byte")
    context, continuation = "0123456789abcdef", "ghi"
    assert lm.loglikelihood([request(context, continuation)]) == [(-sum(map(ord, "ghi")), False)]
    assert scorer.rows == [list((context + continuation)[-9:].encode())]
    with pytest.raises(UserError, match="longer than the model's max_seq_len 8"):
        lm.loglikelihood([request("x", "123456789")])


def test_rolling_windows_score_every_token_once_and_count_tokens():
    scorer = NamingScorer(max_length=8)
    lm = ProjectLM(scorer, "byte", batch_size=3)
    text = "the quick brown fox jumps over the lazy dog"
    assert lm.loglikelihood_rolling([request(text, task="ppl")]) == [-float(sum(text.encode()))]
    assert all(len(r) <= 9 for r in scorer.rows) and len(scorer.rows) == 6  # 43 tokens in windows of 8
    assert lm.rolling["ppl"] == [-float(sum(text.encode())), len(text)]


def test_generation_cuts_the_context_and_stops_at_the_first_stop_sequence():
    scorer = NamingScorer(max_length=16)
    lm = ProjectLM(scorer, "byte", batch_size=4)
    got = lm.generate_until(
        [
            request("0123456789abcdef", {"until": ["\n"], "max_gen_toks": 6}),
            request("xy", {"until": "e", "max_gen_toks": 6}),
            request("zw", {"until": ["nothing"], "max_gen_toks": 6}),
        ]
    )
    assert got == ["abc", "abc\nd", "abc\nde"]
    prompts = [p for batch, _, _ in scorer.prompts for p in batch]
    assert list(b"6789abcdef") in prompts  # 16 - 6 tokens of context, from the left
    assert all(sampling == (0.0, 0, 1.0) for _, _, sampling in scorer.prompts)  # lm-eval's default: greedy
    with pytest.raises(UserError, match="max_gen_toks 16 leaves no context"):
        lm.generate_until([request("a", {"max_gen_toks": 16})])


def test_the_end_of_document_text_always_stops_generation():
    lm = ProjectLM(NamingScorer(max_length=16, text=b"ab\x00cd"), "byte")
    assert lm.generate_until([request("x", {"until": ["zz"], "max_gen_toks": 5})]) == ["ab"]


def test_task_entries_are_sorted_into_names_folders_and_text_files(tmp_path):
    (tmp_path / "mine.yaml").write_text("task: my_task\ndataset_path: json\n")
    (tmp_path / "notes.txt").write_text("some text\n")
    got = parse_tasks(f"hellaswag, {tmp_path / 'mine.yaml'},{tmp_path / 'notes.txt'}")
    assert got.names == ["hellaswag", "my_task", "ppl_notes_txt"]
    assert got.include[0] == str(tmp_path) and got.text_tasks == ["ppl_notes_txt"]
    assert (
        "test: " + str(tmp_path / "notes.txt") in (tmp_path.parent / got.include[1] / "ppl_notes_txt.yaml").read_text()
    )
    for spec, message in (("", "--tasks is empty"), (f"{tmp_path}/missing.txt", "no such file")):
        with pytest.raises(UserError, match=message):
            parse_tasks(spec)


def test_scores_name_task_metric_and_filter():
    results = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "em,strict": 1.0}}}
    assert scores(results) == {"eval/t/acc": 0.5, "eval/t/em/strict": 1.0}


def test_generation_settings_are_read_as_lm_eval_reads_them():
    scorer = NamingScorer(max_length=64)
    lm = ProjectLM(scorer, "byte")
    lm.generate_until(
        [
            request("a", {"max_new_tokens": 3, "temperature": 0.5}),  # a temperature alone means sampling
            request("b", {"max_gen_toks": 4, "do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9}),
            request("c", {"max_gen_toks": 4, "do_sample": False, "temperature": 0.7}),  # greedy, as lm-eval says
        ]
    )
    assert sorted((new, sampling) for _, new, sampling in scorer.prompts) == [
        (3, (0.5, 0, 1.0)),
        (4, (0.0, 0, 1.0)),
        (4, (0.7, 5, 0.9)),
    ]
    with pytest.raises(UserError, match="repetition_penalty are not supported"):
        lm.generate_until([request("a", {"max_gen_toks": 4, "repetition_penalty": 1.2})])


def test_a_bpe_tokenizer_s_end_of_document_token_ends_generation(tmp_path):
    """Its text decodes to nothing (a special token), so the tokens are cut at its id, as transformers stops there."""
    from jaxpar.core.data.bpe import train_tokenizer
    from jaxpar.core.data.tokens import eod_token, text_codec

    (tmp_path / "t.txt").write_text("def f(x):\n    return x + 1\n" * 50)
    path = str(tmp_path / "tokenizer.json")
    train_tokenizer([str(tmp_path / "t.txt")], path, 300)
    encode, eod = text_codec(path)[0], eod_token(path)
    tokens = encode("return x") + [eod] + encode(" + 1")
    lm = ProjectLM(NamingScorer(max_length=64), path)
    lm.scorer.generate = lambda prompts, new, *sampling: [tokens for _ in prompts]
    assert lm.generate_until([request("def", {"max_gen_toks": len(tokens), "until": ["\n"]})]) == ["return x"]


def test_empty_continuations_and_duplicate_text_files_are_refused_or_kept_apart(tmp_path):
    with pytest.raises(UserError, match="continuation is empty"):
        ProjectLM(NamingScorer(max_length=64), "byte")._loglikelihood_tokens([(("a", ""), [97], [])])
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "notes.txt").write_text(f"{folder}\n")
    got = parse_tasks(f"{tmp_path / 'a' / 'notes.txt'},{tmp_path / 'b' / 'notes.txt'}")
    assert got.names == got.text_tasks == ["ppl_notes_txt", "ppl_notes_txt_2"]


def test_lm_eval_s_padding_repeats_count_once_in_the_token_perplexity():
    """lm-eval evens out the ranks' shares with repeats of a rank's last request: its tokens count once."""
    lm = ProjectLM(NamingScorer(max_length=8), "byte")
    a, b = request("abc", task="ppl"), request("defgh", task="ppl")
    lm.loglikelihood_rolling([a, b, b])
    assert lm.rolling["ppl"] == [-float(sum(b"abcdefgh")), 8]
