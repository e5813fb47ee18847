"""Lexical constraints (`decoding.constraints`, in the one search loop): every finished hypothesis holds every
phrase; exactness on tiny models whose outputs can be enumerated; rows without phrases decode as without
constraints; banned phrases never appear; the decoder's checks of bad phrases."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_transformer.decoding import constraints, search
from jax_transformer.decoding.decoders import length_penalties
from tests.helpers.tooling import fuzz

PAD, START, EOS = 0, 1, 2  # the toy models' special ids; START (BOS) is the decoder's first input, never produced


# --- a toy model: logits a random function of the whole past, so that the search cannot be right by luck ---------


def toy_model(seed: int, vocab: int, words: int, length: int, width: int = 16):
    """A random model over `vocab` ids of which only 3 .. 3 + words - 1 (and EOS) are ever likely: its weights,
    for `toy_logits`."""
    key = jax.random.PRNGKey(seed)
    embed = jax.random.normal(key, (length + 1, vocab, width))
    out = jax.random.normal(jax.random.fold_in(key, 1), (width, vocab)) * 2.0
    reachable = (jnp.arange(vocab) == EOS) | ((jnp.arange(vocab) >= 3) & (jnp.arange(vocab) < 3 + words))
    bias = jnp.where(reachable, 0.0, -jnp.inf)  # the others impossible: the beam can be wider than the candidates
    return embed, out, bias


def toy_logits(model, inputs, step):
    """logits (N, V) of the next token from the inputs (N, T) at positions 0 .. step (START first; later positions
    ignored), each position with its own embedding."""
    embed, out, bias = model
    known = jnp.arange(inputs.shape[1]) <= step
    h = jnp.sum(jnp.where(known[None, :, None], embed[jnp.arange(inputs.shape[1]), inputs], 0.0), axis=1)
    return jnp.tanh(h) @ out + bias


def toy_step_fn(model, K: int):
    """The loop's step function for the toy model: the cache holds each slot's input at each position, and a
    hypothesis's past is read through `history` as a model's cache is."""

    def step_fn(tokens, cache, history, step):
        N, T = history.shape
        cache = cache.at[:, step].set(tokens)  # slot n's input at position `step`
        base = (jnp.arange(N) // K * K)[:, None]  # the sentence's first slot
        past = cache[base + history, jnp.arange(T)[None, :]]  # (N, T)
        return toy_logits(model, past, step), cache

    return step_fn


def gnmt(K: int, penalties) -> search.Gnmt:
    """This project's rules (alpha as `penalties` says) for the toy models."""
    return search.Gnmt(
        beams=K, greedy=False, start_id=START, eos_id=EOS, penalties=penalties, min_len=jnp.int32(0), pad_id=PAD,
        bos_id=START,
    )  # fmt: skip


def toy_search(model, rows: search.Rows, penalties, *, K, length, rules=None):
    """A search over the toy model with `rules` (default: this project's, alpha as `penalties` says)."""
    return _toy_search(model, rows, rules or gnmt(K, penalties), length=length)


@functools.partial(jax.jit, static_argnames=("length",))
def _toy_search(model, rows: search.Rows, rules: search.Rules, *, length):
    B, K = rows.limit.shape[0], rules.beams
    cache = jnp.zeros((B * K, length), jnp.int32)
    src = jnp.ones((B, 1), jnp.int32)
    state = search.initial_state(rules, src, rows, length, length, cache, PAD)
    return search.run(state, rules, toy_step_fn(model, K), 0)


def padded(arrays, P: int = 2, M: int = 4):
    """phrase_arrays' (tokens, lengths) padded to P phrases of M tokens: one program for every example."""
    tokens, lengths = arrays
    B, p, m = tokens.shape
    return np.pad(tokens, ((0, 0), (0, P - p), (0, M - m))), np.pad(lengths, ((0, 0), (0, P - p)))


def make_rows(B: int, length: int, limit, phrases=None, ordered=False, banned=None) -> search.Rows:
    rows = search.Rows(
        limit=np.asarray(limit, np.int32) * np.ones(B, np.int32),
        prefix=np.full((B, length), PAD, np.int32),
        prefix_len=np.zeros(B, np.int32),
        draw=np.zeros(B, np.uint32),
    )
    if phrases is not None:
        tokens, lengths = padded(constraints.phrase_arrays(phrases, PAD))
        rows = rows.replace(phrases=tokens, phrase_len=lengths, ordered=np.asarray(ordered) * np.ones(B, bool))
    if banned is not None:
        tokens, lengths = padded(constraints.phrase_arrays(banned, PAD), P=4)
        rows = rows.replace(banned=tokens, banned_len=lengths)
    return rows


def occurs(seq, phrase, start: int = 0) -> int:
    """The end of the first occurrence of `phrase` in `seq` at or after `start`, or -1."""
    for i in range(start, len(seq) - len(phrase) + 1):
        if list(seq[i : i + len(phrase)]) == list(phrase):
            return i + len(phrase)
    return -1


def holds(seq, phrases, ordered: bool) -> bool:
    if not ordered:
        return all(occurs(seq, p) >= 0 for p in phrases)
    end = 0
    for p in phrases:
        end = occurs(seq, p, end)
        if end < 0:
            return False
    return True


def output(tokens) -> list[int]:
    """An output row's tokens up to its EOS (EOS left out) or its padding."""
    out = []
    for tok in tokens:
        if tok in (EOS, PAD):
            break
        out.append(int(tok))
    return out


# --- exactness ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_constrained_search_is_exact_on_enumerable_models():
    """20 random toy models, 3 words, outputs of at most 5 tokens (EOS included): every output is enumerated and
    scored with the model's own log-probs and the rules' length penalty; with a beam wider than every step's
    candidates (324: 81 hypotheses of 4 tokens x 4 extensions) the search's best is the best output that holds the
    phrases, ordered or not, for two rows of a batch at once."""
    words, limit, K, vocab = 3, 5, 324, 6
    rng = np.random.default_rng(0)
    word_ids = list(range(3, 3 + words))
    outputs = [list(w) + [EOS] for n in range(limit) for w in itertools.product(word_ids, repeat=n)]
    outputs += [list(w) for w in itertools.product(word_ids, repeat=limit)]  # reaching the limit, no EOS
    prefixes = sorted({tuple(o[:i]) for o in outputs for i in range(len(o))})
    for case in range(20):
        alpha = float(rng.choice([0.0, 0.6, 1.5]))
        ordered = bool(rng.integers(2))
        phrases = [
            [list(rng.choice(word_ids, size=rng.integers(1, 3))) for _ in range(rng.integers(1, 3))] for _ in range(2)
        ]
        penalties = jnp.asarray(length_penalties(limit, alpha))
        rows = make_rows(2, limit, limit, phrases, ordered)
        model = toy_model(case, vocab, words, limit)
        state = toy_search(model, rows, penalties, K=K, length=limit)
        # Every output's log P: the model's log-probs at each of its prefixes (PAD and BOS banned, no renormalising).
        inputs = np.full((len(prefixes), limit), PAD, np.int32)
        for i, p in enumerate(prefixes):
            inputs[i, : len(p) + 1] = [START, *p]
        steps = np.array([len(p) for p in prefixes])
        with jax.default_matmul_precision("highest"):
            table = np.stack(
                [np.asarray(jax.nn.log_softmax(toy_logits(model, jnp.asarray(inputs), t))) for t in range(limit)]
            )
        log_probs = {p: table[steps[i], i] for i, p in enumerate(prefixes)}
        for b in range(2):
            scored = []
            for o in outputs:
                if holds(output(o), phrases[b], ordered):
                    log_p = sum(float(log_probs[tuple(o[:i])][tok]) for i, tok in enumerate(o))
                    scored.append((log_p / float(penalties[len(o)]), o))
            best_score, best = max(scored)
            got = np.asarray(state.finished_tokens[b, 0])
            assert bool(state.finished[b, 0]), (case, b)
            assert list(got[: len(best)]) == best and all(got[len(best) :] == PAD), (case, b, phrases[b], ordered)
            # float32 sums of up to 5 log-probs in another order than the loop's: a few ulps of their size.
            assert float(state.finished_scores[b, 0]) == pytest.approx(best_score, rel=1e-5, abs=1e-5)
            assert holds(output(got), phrases[b], ordered)


@pytest.mark.parametrize("forced_bos", [-1, 7])
def test_transformers_rules_with_forced_codes_and_repetition_controls_hold_every_phrase(forced_bos):
    """transformers' rules (a forced first token as a multilingual model's language code, a repetition penalty,
    no repeated 3-grams, 3 best kept): every hypothesis found holds its row's phrases, unordered and ordered."""
    model = toy_model(2, 12, 6, 10)
    rules = search.Transformers(
        beams=4, greedy=False, start_id=START, eos_id=EOS, min_length=jnp.int32(0), length_penalty=jnp.float32(1.0),
        forced_bos=jnp.int32(forced_bos), max_length=11, banned=(PAD, START), forced_eos=False,
        early_stopping="false", no_repeat_ngram=3, penalize=True, repetition_penalty=jnp.float32(1.3),
    )  # fmt: skip
    phrases = [[[4, 5], [6]], [[3]], [[8, 3, 4]], None]
    for ordered in (False, True):
        state = toy_search(model, make_rows(4, 10, 9, phrases, ordered), None, K=4, length=10, rules=rules)
        for b, k in itertools.product(range(3), range(4)):
            assert bool(state.finished[b, 0])
            if state.finished[b, k]:
                tokens = output(np.asarray(state.finished_tokens[b, k]))
                assert holds(tokens, phrases[b], ordered), (b, k, tokens)
                assert forced_bos < 0 or tokens[0] == forced_bos


# --- every finished hypothesis holds every phrase; rows without phrases decode as without constraints -------------


PHRASE = st.lists(st.integers(3, 8), min_size=1, max_size=3)


@pytest.mark.slow
@fuzz(12)
@given(
    K=st.sampled_from([2, 4]),
    phrases=st.lists(st.one_of(st.none(), st.lists(PHRASE, min_size=1, max_size=2)), min_size=3, max_size=3),
    ordered=st.booleans(),
    seed=st.integers(0, 3),
    limit=st.integers(6, 9),
)
def test_every_finished_hypothesis_holds_every_phrase(K, phrases, ordered, seed, limit):
    """Random toy models (6 words), beams, phrases per batch position (some rows none): every hypothesis found
    holds its row's phrases (in order where asked), and a row without phrases has exactly the tokens and scores of
    a search without constraints."""
    model, penalties = toy_model(seed, 12, 6, 10), jnp.asarray(length_penalties(10, 0.6))
    state = toy_search(model, make_rows(3, 10, limit, phrases, ordered), penalties, K=K, length=10)
    plain = toy_search(model, make_rows(3, 10, limit), penalties, K=K, length=10)
    for b in range(3):
        if phrases[b] is None:
            np.testing.assert_array_equal(state.finished_tokens[b], plain.finished_tokens[b])
            np.testing.assert_array_equal(state.finished_scores[b], plain.finished_scores[b])
            continue
        assert bool(state.finished[b, 0])  # the limit leaves room for every phrase (at most 6 tokens in all)
        for k in range(K):
            if state.finished[b, k]:
                tokens = np.asarray(state.finished_tokens[b, k])
                assert holds(output(tokens), phrases[b], ordered), (b, k, tokens, phrases[b])


@fuzz(15)
@given(banned=st.lists(st.lists(st.integers(3, 8), min_size=1, max_size=2), min_size=1, max_size=3))
def test_banned_phrases_never_appear(banned):
    """No hypothesis found (live or finished) holds a banned phrase; greedy search too."""
    model, penalties = toy_model(1, 12, 6, 8), jnp.asarray(length_penalties(8, 0.6))
    state = toy_search(model, make_rows(2, 8, 8, banned=[banned, banned]), penalties, K=4, length=8)
    for b, k in itertools.product(range(2), range(4)):
        if state.finished[b, k]:
            found = output(np.asarray(state.finished_tokens[b, k]))
            assert all(occurs(found, p) < 0 for p in banned), (found, banned)


# --- through translate: Translator.translate(constraints=...), translate --constraints / --input-format jsonl -----


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from jax_transformer import Translator
    from tests.helpers.saved import load_saved_model, saved_run

    run = saved_run(tmp_path_factory.mktemp("constraints") / "run")
    return run, Translator(run, "latest"), load_saved_model("trained_tiny").source_texts[:6]


def contains(tokens, phrase) -> bool:
    return occurs(list(tokens), phrase) >= 0


@pytest.mark.slow
def test_translator_constraints_hold_and_rows_without_them_are_unchanged(saved):
    """Each hypothesis of a sentence with constraints holds its phrases (tokenized as target text in a sentence);
    a sentence without, in the same batch, has exactly the hypotheses of a decoding without constraints; ordered
    phrases come in their order."""
    from jax_transformer.decoding.translation import encode_phrase

    _, translator, sentences = saved
    wanted = [["trois"], None, ["onze", "cent"], None, ["vingt", "deux"], None]
    got = translator.translate(sentences, constraints=wanted, beam_size=4, n_best=2)
    plain = translator.translate(sentences, beam_size=4, n_best=2)
    ordered = translator.translate(sentences, constraints=wanted, beam_size=4, constraint_order="ordered")
    for phrases, ours, theirs, in_order in zip(wanted, got, plain, ordered):
        if phrases is None:
            assert [h.tokens for h in ours.hypotheses] == [h.tokens for h in theirs.hypotheses]
            assert [h.score for h in ours.hypotheses] == [h.score for h in theirs.hypotheses]
            continue
        ids = [encode_phrase(translator.tokenizer, p) for p in phrases]
        assert ours.hypotheses and in_order.hypotheses
        for h in ours.hypotheses:
            assert all(contains(h.tokens, p) for p in ids), (h.text, phrases)
        assert holds(in_order.hypotheses[0].tokens, ids, ordered=True), (in_order.text, phrases)


@pytest.mark.slow
def test_translate_constraints_and_jsonl_on_the_command_line(saved, tmp_path):
    """--constraints reads fairseq's source<TAB>phrase... lines, --input-format jsonl a prefix and constraints
    together; each translation holds its phrases (and begins with its prefix)."""
    import json

    from tests.helpers.training import run_main

    run, translator, _ = saved
    path = tmp_path / "input.txt"
    path.write_text("one hundred and two\ttrois\none hundred and three\n\none hundred and eleven\tvingt\tcent\n")
    args = ["translate", "--checkpoint", str(run), "--input", str(path), "--beam-size", "4"]
    code, out, err = run_main([*args, "--constraints"])
    assert code == 0, out + err
    lines = out.splitlines()
    assert len(lines) == 4 and lines[2] == ""
    assert "trois" in lines[0].split() and {"vingt", "cent"} <= set(lines[3].split())
    records = [
        {"source": "one hundred and two", "prefix": "cent", "constraints": ["trois"]},
        {"source": "one hundred and three"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, out, err = run_main([*args, "--input-format", "jsonl", "--output-format", "jsonl"])
    assert code == 0, out + err
    first = json.loads(out.splitlines()[0])
    assert first["hypotheses"][0]["text"].split()[0] == "cent" and "trois" in first["hypotheses"][0]["text"].split()


@pytest.mark.parametrize(
    "line, options, message",
    [
        ("one\t", [], "constraint 1 is empty"),
        ("one\tcent\t  ", [], "constraint 2 is empty"),
        ("one\t\u4e2d\u6587", [], "characters the target vocabulary does not know"),
        ("one\tcent\tdeux\ttrois", ["--beam-size", "2"], "more than this search takes"),
        ("one\tcent", ["--beam-size", "1"], "need beam search"),
        ("one\t" + "\t".join(["cent deux trois"] * 4), ["--max-len-b", "2"], "more than the"),
    ],
)
def test_bad_constraints_are_errors_naming_the_line_and_nothing_is_written(saved, tmp_path, line, options, message):
    from tests.helpers.training import run_main

    run, _, _ = saved
    path = tmp_path / "input.txt"
    path.write_text(f"one hundred\n{line}\n")
    code, out, err = run_main(["translate", "--checkpoint", str(run), "--input", str(path), "--constraints", *options])
    assert code != 0 and out == ""
    assert f"{path}, line 2" in err and message in err, err


# --- the glossary ---------------------------------------------------------------------------------------------------


def test_glossary_terms_match_whole_words_in_any_case_and_bad_lines_name_file_and_line(tmp_path):
    from jax_transformer.decoding.glossary import Glossary
    from jax_transformer.errors import DataError

    path = tmp_path / "terms.tsv"
    path.write_text("hundred\tcent\n\nNew York\tNew York\nyork\tYork\n", encoding="utf-8")
    glossary = Glossary.read(path)
    assert glossary.terms("One HUNDRED and two") == ["cent"]
    assert glossary.terms("hundreds") == []  # whole words only
    assert glossary.terms("in new york") == ["New York", "York"]  # a term inside a longer one counts too
    assert glossary.constraints("one hundred", ["cent", "deux"]) == ["cent", "deux"]
    assert glossary.constraints("nothing") is None
    for bad in ("hundred\n", "hundred\tcent\textra\n", "\tcent\n"):
        path.write_text("one\tun\n" + bad, encoding="utf-8")
        with pytest.raises(DataError, match=f"{path}, line 2: expected"):
            Glossary.read(path)


@pytest.mark.slow
def test_translate_glossary_on_the_command_line(saved, tmp_path):
    """Each line whose source holds a glossary term gets its target term; a bad glossary line is an error naming
    the file and line, before anything is written."""
    from tests.helpers.training import run_main

    run, _, _ = saved
    terms, path = tmp_path / "terms.tsv", tmp_path / "input.txt"
    terms.write_text("two\ttrois\n", encoding="utf-8")
    path.write_text("one hundred and two\none hundred and three\n", encoding="utf-8")
    args = ["translate", "--checkpoint", str(run), "--input", str(path), "--glossary", str(terms)]
    code, out, err = run_main(args)
    assert code == 0, out + err
    assert "trois" in out.splitlines()[0].split()
    code, out, err = run_main([*args, "--document", "--beam-size", "4"])  # each sentence of a document too
    assert code == 0, out + err
    assert "trois" in out.splitlines()[0].split()
    terms.write_text("two\ttrois\nthree\n", encoding="utf-8")
    code, out, err = run_main(args)
    assert code != 0 and out == "" and f"{terms}, line 2" in err


@pytest.mark.slow
def test_the_cpu_schedule_carries_the_constraint_state_as_rows_leave_and_the_cache_grows():
    """8 sentences on the CPU's schedule (rows leave the batch at 4 open, the cache grows from 16 positions) give
    the hypotheses of the batch decoded whole: the constraint arrays and state follow the rows."""
    from jax_transformer.decoding import decoders
    from jax_transformer.decoding.schedule import Scheduled, Whole
    from jax_transformer.settings.config import DecodeConfig
    from tests.helpers.saved import load_saved_model

    saved = load_saved_model("trained_tiny")
    src = saved.sources[:8]
    decoder = decoders.decoder(saved.config, DecodeConfig(beam_size=4, n_best=2), src.shape[1])
    phrases = [[[21]] if i % 3 else [[21], [int(saved.sources[i][0]) % 200 + 4]] for i in range(8)]
    phrases[5] = None
    whole = decoder(saved.params, src, Whole(), None, phrases)
    parts = decoder(saved.params, src, Scheduled(split=False), None, phrases)
    np.testing.assert_array_equal(whole.tokens, parts.tokens)
    np.testing.assert_array_equal(whole.found, parts.found)
    np.testing.assert_allclose(whole.scores, parts.scores, rtol=1e-5)  # smaller matrix products: rounding only
    assert whole.found[:, 0].all()


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "not a JSON object"),
        ('{"text": "one"}', 'expected an object with a "source" string'),
        ('{"source": "one", "constraints": "cent"}', '"constraints" must be a list of strings'),
        ('{"source": "one", "constraints": ["cent"], "extra": 1}', "unknown field 'extra'"),
        ('{"source": "one", "constraints": [""]}', "constraint 1 is empty"),
    ],
)
def test_bad_jsonl_lines_are_errors_naming_the_line_and_nothing_is_written(saved, tmp_path, line, message):
    from tests.helpers.training import run_main

    run, _, _ = saved
    path = tmp_path / "input.jsonl"
    path.write_text('{"source": "one hundred", "constraints": ["cent"]}\n' + line + "\n", encoding="utf-8")
    code, out, err = run_main(["translate", "--checkpoint", str(run), "--input", str(path), "--input-format", "jsonl"])
    assert code != 0 and out == ""
    assert f"{path}, line 2" in err and message in err, err


def test_constraints_with_a_prefix_column_are_refused(saved, tmp_path):
    from tests.helpers.training import run_main

    run, _, _ = saved
    code, out, err = run_main(["translate", "--checkpoint", str(run), "--constraints", "--input-format", "tsv"])
    assert code != 0 and out == "" and "--input-format jsonl" in err


def test_a_fixed_constraint_size_pads_every_row_to_it_and_refuses_more():
    """--constraint-size PxM (a service's one compiled size): phrases padded to exactly (P, M), more or longer ones
    a ValueError; the setting's range is the decoder's."""
    from jax_transformer.errors import ConfigError
    from jax_transformer.settings.config import DecodeConfig

    tokens, lengths = constraints.phrase_arrays([[[5]], None], pad_id=0, size=(2, 8))
    assert tokens.shape == (2, 2, 8) and lengths.tolist() == [[1, 0], [0, 0]] and tokens[0, 0, 0] == 5
    with pytest.raises(ValueError, match="3 phrases in a row: at most 2"):
        constraints.phrase_arrays([[[5], [6], [7]]], pad_id=0, size=(2, 8))
    with pytest.raises(ValueError, match="9 tokens in a phrase: at most 8"):
        constraints.phrase_arrays([[list(range(1, 10))]], pad_id=0, size=(2, 8))
    most = f"{constraints.PHRASE_SIZES[-1]}x{constraints.TOKEN_SIZES[-1]}"
    assert DecodeConfig(constraint_size=most).phrase_size() == constraints.parse_size(most)
    for bad in ("2", "0x8", f"{constraints.PHRASE_SIZES[-1] + 1}x8", f"2x{constraints.TOKEN_SIZES[-1] + 1}"):
        with pytest.raises(ConfigError, match="constraint_size"):
            DecodeConfig(constraint_size=bad)
        with pytest.raises(ValueError):
            constraints.parse_size(bad)
