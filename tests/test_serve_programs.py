"""What a service compiles is known at start: `compile_every_shape` lists every program a decoding may run at the
batch shapes of a token budget, whatever the sources' lengths and however their sentences finish, and after those
are compiled, a stream of requests of mixed lengths and run-time options compiles and traces nothing (jax's own
compile events, `compilation.CompileLog`, not timing). The CPU schedule's thresholds are lowered here so that a
small budget goes through every path a large one does (halves side by side, rows leaving the batch, the cache
growing by phases) with few programs. `Allowed` and `signature`: which options are parts of a program."""

from __future__ import annotations

import random

import numpy as np
import pytest

from jax_transformer.compilation import CompileJobs, CompileLog
from jax_transformer.decoding import schedule as schedules
from jax_transformer.decoding import translation
from jax_transformer.errors import ConfigError
from jax_transformer.serving.programs import Allowed, parse_allow, signature
from jax_transformer.settings.config import DecodeConfig
from tests.helpers.saved import load_saved_model

MODEL = load_saved_model("trained_tiny")
WIDTHS = translation.decode_widths(MODEL.config.max_len)


@pytest.fixture
def small_thresholds(monkeypatch):
    """Every path of the CPU schedule at 2 and 4 rows: two halves from 4 rows, shrinking to 1 row, a cache that
    grows by phases from 2 hypotheses."""
    monkeypatch.setattr(schedules, "PARTED_FROM", 4)
    monkeypatch.setattr(schedules, "SMALLEST_LEVEL", 1)
    monkeypatch.setattr(schedules, "PHASED_FROM", 2)
    monkeypatch.setattr(schedules, "side_by_side", lambda: 2)  # (on one core too: the programs are the same)


@pytest.mark.slow
def test_after_every_program_is_compiled_no_request_compiles(small_thresholds):
    decodes = [  # a beam search (rows leave the batch, the cache grows); sampling with the penalty (n rows each)
        DecodeConfig(beam_size=2),
        DecodeConfig(rules="transformers", beam_size=1, do_sample=True, n_best=2, repetition_penalty=1.3),
    ]
    budget = 64
    schedules_served = [schedules.serving()]
    shapes = translation.budget_shapes(budget, MODEL.config.max_len)
    assert shapes == [(1, 16), (2, 16), (4, 16), (1, 32), (2, 32)]  # rows x width <= 64, and one row at any width
    jobs = {}
    for decode in decodes:
        for schedule in schedules_served:
            jobs.update(translation.compile_every_shape(MODEL.params, MODEL.config, decode, shapes, schedule))
    compiled = CompileJobs(jobs)
    compiled.wait()
    assert not compiled.errors
    before = CompileLog.snapshot()
    rng = random.Random(0)
    words = " ".join(MODEL.source_texts).split()
    for _ in range(24):  # mixed lengths and counts; run-time options drawn anew each time
        sentences = [" ".join(rng.choices(words, k=rng.randint(1, 12))) for _ in range(rng.choice([1, 2, 3, 4, 7]))]
        decode = rng.choice(decodes)
        if decode.do_sample:
            decode = decode.replace(temperature=rng.uniform(0.5, 1.5), sample_seed=rng.randint(0, 9))
        else:
            decode = decode.replace(alpha=rng.uniform(0, 2), min_length=rng.randint(0, 3))
        if decode.rules == "transformers":
            decode = decode.replace(repetition_penalty=rng.uniform(1.05, 2.0))
        translation.translations(
            MODEL.params, MODEL.config, MODEL.tokenizer, sentences, decode, max_tokens=budget, progress=False,
            schedule=rng.choice(schedules_served),
        )  # fmt: skip
    # (A first call may trace its function again where jax's trace cache dropped it; what it compiles is found.)
    assert CompileLog.snapshot()["compiles"] == before["compiles"]


def test_a_program_left_out_is_seen_compiling(small_thresholds):
    """The check above can fail: a shape not compiled ahead is a compile event."""
    schedule = schedules.serving()
    # (an unusual decoding, so that no other test of the process has compiled its programs)
    decode = DecodeConfig(rules="transformers", beam_size=3, no_repeat_ngram_size=4, banned="7")
    jobs = translation.compile_every_shape(MODEL.params, MODEL.config, decode, [(1, 16)], schedule)
    CompileJobs(jobs).wait()
    before = CompileLog.snapshot()
    sentences = [" ".join(MODEL.source_texts[:3])] * 3  # three rows: a shape left out
    translation.translations(MODEL.params, MODEL.config, MODEL.tokenizer, sentences, decode, max_tokens=64,
                             progress=False, schedule=schedule)  # fmt: skip
    assert CompileLog.snapshot()["compiles"] > before["compiles"]


def test_run_time_options_share_a_program_and_the_others_do_not():
    base = DecodeConfig(rules="transformers", beam_size=2)
    same = signature(MODEL.config, base, WIDTHS)
    for changes in ({"alpha": 1.7}, {"min_length": 3}, {"forced_bos": 5}, {"repetition_penalty": 1.2}):
        penalized = base.replace(repetition_penalty=1.5)
        reference = signature(MODEL.config, penalized if "repetition_penalty" in changes else base, WIDTHS)
        assert signature(MODEL.config, base.replace(**changes), WIDTHS) == reference, changes
    sampled = base.replace(do_sample=True, beam_size=1)
    assert signature(MODEL.config, sampled.replace(temperature=0.5, top_p=0.9, sample_seed=7), WIDTHS) == signature(
        MODEL.config, sampled, WIDTHS
    )
    for changes in ({"beam_size": 3}, {"no_repeat_ngram_size": 2}, {"max_length": 20}, {"banned": "5"},
                    {"repetition_penalty": 1.2}, {"early_stopping": "true"}, {"rules": "gnmt"}):  # fmt: skip
        assert signature(MODEL.config, base.replace(**changes), WIDTHS) != same, changes
    gnmt = DecodeConfig(beam_size=2)
    assert signature(MODEL.config, gnmt.replace(max_len_a=1.0), WIDTHS) != signature(MODEL.config, gnmt, WIDTHS)


def test_allowed_decodings_are_the_valid_combinations_and_refusals_name_the_option():
    base = DecodeConfig(beam_size=2)
    allowed = Allowed(MODEL.config, base, parse_allow("beam_size=1,4 do_sample=true top_k=0,5"))
    # beam 2, 1, 4 x sampling off; sampling with top_k 0 or 5 (its beam unused); top_k without sampling: refused.
    assert len(allowed.decodes) == 5
    assert allowed.fault(base.replace(alpha=1.9), {"alpha": 1.9}, "options") is None
    message = allowed.fault(base.replace(beam_size=3), {"beam_size": 3}, "options")
    assert message == (
        "options.beam_size 3: this service does not run it (it compiles its programs at start); allowed: 2, 1, 4"
    )
    sampled = base.replace(do_sample=True, top_k=7)
    assert "options.top_k 7" in allowed.fault(sampled, {"do_sample": True, "top_k": 7}, "options")
    assert allowed.fault(base.replace(do_sample=True, top_k=5), {"do_sample": True, "top_k": 5}, "options") is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("beams=2", "'beams' is not a decoding setting"),
        ("beam_size", "expected FIELD=VALUE"),
        ("beam_size=two", "beam_size 'two' is not a int"),
        ("do_sample=yes", "do_sample 'yes' is not a bool"),
    ],
)
def test_allow_errors_name_the_item(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_allow(text)


def test_allow_reads_each_type():
    assert parse_allow("beam_size=1,4 do_sample=true alpha=0.5 rules=transformers max_length=none,20") == {
        "beam_size": [1, 4], "do_sample": [True], "alpha": [0.5], "rules": ["transformers"], "max_length": [None, 20],
    }  # fmt: skip
    assert np.isclose(parse_allow("repetition_penalty=1.2")["repetition_penalty"][0], 1.2)
