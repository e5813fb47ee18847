"""The decoding options of `decoding.decoder(config, DecodeConfig(rules="transformers", ...), width)` against
transformers' `generate` (eager attention, float32), on the tiny random models of test_pretrained.py (Marian with
the pad banned and EOS forced at the limit, FSMT with EOS forced) and test_multilingual.py (M2M-100, its target
language's code forced first):

- n-best lists: `n_best=4` of beam 4 gives transformers' `num_return_sequences=4` hypotheses token for token, their
  `sequences_scores` and per-token scores (`compute_transition_scores(sequences, scores, beam_indices)`), under two
  length penalties; greedy search's per-token log-probs are `compute_transition_scores(...,
  normalize_logits=True)` and its score their sum.
- target prefixes: one batch whose rows have prefixes of 0 to 3 tokens (a multilingual model's after its language
  code) decodes each row as transformers does after `decoder_input_ids=[[start] + prefix]`: the same tokens,
  greedy and beam 4, and the same beam scores and per-token scores (a prefix's tokens scored 0 and not counted in
  the length penalty's length).
- sampling: `search.Sampler.warp` is transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper
  in that order, ties and -inf entries included; top_k=1 samples transformers' greedy tokens and scores; the first
  free tokens of 600 samples of a sentence follow the distribution of transformers' own warped scores at that
  step (chi-square); a sentence's samples are the same alone, in a batch and at another place in it, and other
  with another seed; their per-token scores are the model's log-probs after the rules (teacher-forced through
  transformers' model), not those of the warped scores.

Every test also checks that the option changed something (distinct hypotheses of several lengths, continuations
other than plain decoding's, other samples with another seed), so that agreement is not that of unchanged outputs.
Each decoding runs its batch whole (`schedule.Whole`, one program per search; the CPU's schedule gives the same
results, tests/test_decoding.py); options that are arguments of a program (length penalty, prefixes, seed,
temperature, top_p) reuse it. The M2M-100 tests are a class: pytest-xdist (--dist loadscope) runs them beside the
module's others, each half compiling three searches. (mBART-50 is left out: a fourth model's searches to compile,
for rules its generate test in test_multilingual.py covers already.)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from jax_transformer.data.default_task import default_pairs
from jax_transformer.decoding.decoders import Decoded, check_source, decoder
from jax_transformer.decoding.schedule import Whole
from jax_transformer.decoding.search import Sampler
from jax_transformer.interop import hub
from jax_transformer.settings.config import DecodeConfig
from parity_tests.test_decoding_parity import one_torch_thread  # noqa: F401 (an autouse fixture)
from parity_tests.test_multilingual import _imported
from parity_tests.test_pretrained import MAX_LENGTH, SOURCES, _saved, _their_model
from tests.helpers.batches import pad_rows
from tests.helpers.multilingual import saved_model
from tests.helpers.pretrained import fsmt_tokenizer_files, marian_tokenizer_files, tiny_fsmt, tiny_marian
from tests.helpers.saved import load_saved_model

pytest.importorskip("transformers")
pytest.importorskip("sacremoses")
stats = pytest.importorskip("scipy.stats")  # (a dependency of jax)

# Scores and per-token log-probs: the logits agree within 1e-5 (test_pretrained.py), a log-prob is a logit less a
# float32 logsumexp summed in another order, and a score sums at most MAX_LENGTH - 1 of them: a few 1e-6 are seen.
# A wrong token, a prefix token scored or counted in the length (one token more moves log P / length by 1/17 of
# itself), or a log-prob of another step moves a score by 1e-2 or more.
SCORE_ATOL = 1e-4
# Warped scores: both divide by the temperature in float32; XLA may multiply by the reciprocal instead, one ulp of
# scores up to ~30 in size (~4e-6). Everything else the warpers do sets entries to -inf.
WARP_ATOL = 1e-5
BEAMS = N_BEST = 4  # n-best: every hypothesis the beam search keeps
PREFIX_LENGTHS = (0, 1, 2, 3)  # row i's prefix: PREFIX_LENGTHS[i % 4] target tokens (after a language code)


@dataclasses.dataclass
class Case:
    """A saved model read by both sides: ours (config, params, tokenizer) and transformers' (`theirs`), SOURCES
    (right-padded, with EOS), and the generate options of its family as test_pretrained.py's and
    test_multilingual.py's generate tests pass them, which `decode_config` mirrors."""

    config: Any
    params: Any
    tokenizer: Any
    theirs: Any
    src: np.ndarray
    options: dict

    @property
    def forced_bos(self) -> int | None:
        return self.options.get("forced_bos_token_id")

    def decode_config(self, **fields) -> DecodeConfig:
        """Our DecodeConfig of `options`, and `fields`. alpha always given: DecodeConfig's default, 0.6 (the GNMT
        rules'), is not transformers' length_penalty default, 1.0."""
        mirrored = dict(
            alpha=1.0,
            max_length=self.options["max_length"],
            forced_eos=self.options.get("forced_eos_token_id") is not None,
            banned=",".join(str(i) for [i] in self.options.get("bad_words_ids", [])),
            forced_bos=self.forced_bos,
        )
        return DecodeConfig(rules="transformers", **{**mirrored, **fields})

    def ours(self, decode: DecodeConfig, src=None, prefixes=None) -> Decoded:
        src = check_source(self.src if src is None else src, self.config)
        return decoder(self.config, decode, src.shape[1])(self.params, src, Whole(), prefixes)

    def generate(self, src=None, decoder_input_ids=None, **options):
        """transformers' generate with its scores, on `src` (default: all of SOURCES)."""
        src = self.src if src is None else src
        if decoder_input_ids is not None:
            options["decoder_input_ids"] = torch.tensor(decoder_input_ids, dtype=torch.long)
        with torch.no_grad():
            return self.theirs.generate(
                input_ids=torch.tensor(src, dtype=torch.long),
                attention_mask=torch.tensor(src != self.config.pad_id, dtype=torch.long),
                output_scores=True,
                return_dict_in_generate=True,
                **{"do_sample": False, **self.options, **options},
            )

    def transition_scores(self, out, beams: bool) -> np.ndarray:
        """(rows, generated steps): beam search's processed log-probs of the chosen tokens, or the log-softmax of
        greedy search's processed scores."""
        with torch.no_grad():
            if beams:
                return self.theirs.compute_transition_scores(out.sequences, out.scores, out.beam_indices).numpy()
            return self.theirs.compute_transition_scores(out.sequences, out.scores, normalize_logits=True).numpy()


def _own_case(folder: Path) -> Case:
    """This project's own trained model (tests/data/trained_tiny.npz: a BOS start token, interleaved sinusoids),
    exported to transformers as a MarianMTModel (`hub.export_transformers`), against its Flax self."""
    saved = load_saved_model("trained_tiny")
    config = saved.config
    hub.export_transformers(saved.params, config, saved.tokenizer, {"decode": DecodeConfig().to_dict()}, folder)
    src = pad_rows([tokens + [config.eos_id] for tokens in saved.tokenizer.encode_batch(SOURCES)], config.pad_id)
    # length_penalty as `decode_config` mirrors it: the export wrote this project's alpha, 0.6, as the model's default
    options = dict(bad_words_ids=[[config.pad_id]], forced_eos_token_id=config.eos_id, length_penalty=1.0)
    return Case(config, saved.params, saved.tokenizer, _their_model(folder), src, dict(options, max_length=MAX_LENGTH))


def _case(family: str, folder: Path) -> Case:
    if family == "own":
        return _own_case(folder)
    if family in ("marian", "fsmt"):
        model = hub.read_pretrained(folder)
        tokenizer = model.tokenizer
        options = dict(forced_eos_token_id=model.config.eos_id)
        if family == "marian":
            options["bad_words_ids"] = [[model.config.pad_id]]
    else:
        model, tokenizer = _imported(folder, family)
        options = dict(forced_bos_token_id=tokenizer.forced_bos_id)
    config, theirs = model.config, _their_model(folder)
    if theirs.generation_config.forced_eos_token_id is not None:  # mBART's config forces EOS at the limit
        options["forced_eos_token_id"] = theirs.generation_config.forced_eos_token_id
    src = pad_rows([tokenizer.encode(s) + [config.eos_id] for s in SOURCES], pad_id=config.pad_id)
    return Case(config, model.params, tokenizer, theirs, src, dict(options, max_length=MAX_LENGTH))


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """cases(family) -> its Case, each model built on first use (a pytest-xdist worker builds only its own)."""
    built = {}

    def get(family: str) -> Case:
        if family not in built:
            folder = tmp_path_factory.mktemp(family)
            if family == "own":
                pass  # exported by _case
            elif family == "marian":
                _saved(tiny_marian(marian_tokenizer_files(folder), shared=True), folder)
            elif family == "fsmt":
                _saved(tiny_fsmt(fsmt_tokenizer_files(folder)), folder)
            else:
                saved_model(family, folder, SOURCES, MAX_LENGTH)
            built[family] = _case(family, folder)
        return built[family]

    return get


def _rows(x: np.ndarray) -> np.ndarray:
    """(B, n, ...) -> (B * n, ...), the order of transformers' num_return_sequences rows."""
    return x.reshape(-1, *x.shape[2:])


def _lengths(tokens: np.ndarray, eos: int) -> np.ndarray:
    """Each row's length up to its first EOS, included (its width where it has none)."""
    ends = tokens == eos
    return np.where(ends.any(axis=-1), ends.argmax(axis=-1) + 1, tokens.shape[-1])


def _after_end(tokens: np.ndarray, eos: int) -> np.ndarray:
    """(rows, L) True after each row's first EOS."""
    return np.cumsum(tokens == eos, axis=1) - (tokens == eos) > 0


def _compare(case: Case, ours: Decoded, out, beams: bool, prompt: int = 0) -> tuple[float, float]:
    """Our hypotheses against transformers' `out` (rows in the same order; `prompt` tokens forced after the start
    token): tokens identical, PAD after theirs end; per-token scores and scores within SCORE_ATOL. Returns the
    largest differences (per-token, score)."""
    pad, eos = case.config.pad_id, case.config.eos_id
    theirs = out.sequences.numpy()[:, 1:]  # without the start token
    tokens, width = _rows(ours.tokens), theirs.shape[1]
    assert ours.found.all()
    # Identical up to each EOS; after it ours is PAD, theirs what its beam search filled the row with (the pad id
    # for the tiny models, EOS for this project's exported one).
    ended = _after_end(theirs, eos)
    np.testing.assert_array_equal(tokens[:, :width], np.where(ended, pad, theirs))
    assert (tokens[:, width:] == pad).all()
    transition = case.transition_scores(out, beams)  # (rows, width - prompt): the generated tokens only
    token_scores = _rows(ours.token_scores)
    assert (token_scores[:, :prompt] == 0).all()  # a prefix's tokens are given, not chosen
    # Up to each hypothesis's EOS: after it, transformers' beam search scores 0 (as ours), its greedy search the
    # PAD it appends.
    assert (token_scores[:, width:] == 0).all() and (token_scores[:, :width][ended] == 0).all()
    live = ~ended[:, prompt:]
    token_diff = float(np.abs(np.where(live, token_scores[:, prompt:width] - transition, 0)).max())
    if beams:
        expected = out.sequences_scores.numpy()
    else:  # log P, the sum of the log-probs (transformers gives greedy search no sequence score)
        expected = np.where(live, transition, 0).sum(axis=1)
    score_diff = float(np.abs(ours.scores.reshape(-1) - expected).max())
    assert token_diff <= SCORE_ATOL, token_diff
    assert score_diff <= SCORE_ATOL, score_diff
    return token_diff, score_diff


# =============================================================================================================
# n-best lists and scores
# =============================================================================================================


def check_n_best(case: Case, what: str, parity_report, lengths: int = 3) -> None:
    """Beam 4, its 4 hypotheses, as num_return_sequences=4, with two length penalties: the default 1.0 (long
    hypotheses favoured) and 0.5 (short ones gain); hypotheses of at least `lengths` lengths among them."""
    seen_lengths = set()
    for length_penalty in (1.0, 0.5):
        out = case.generate(num_beams=BEAMS, num_return_sequences=N_BEST, length_penalty=length_penalty)
        ours = case.ours(case.decode_config(beam_size=BEAMS, n_best=N_BEST, alpha=length_penalty))
        token_diff, score_diff = _compare(case, ours, out, beams=True)
        parity_report("n-best per-token scores vs transformers", f"{what} lp {length_penalty}", token_diff, SCORE_ATOL)
        parity_report("n-best sequences_scores vs transformers", f"{what} lp {length_penalty}", score_diff, SCORE_ATOL)
        # A list: distinct hypotheses, best first, the first the top-1 decoding's.
        assert all(len({tuple(h) for h in row}) == N_BEST for row in ours.tokens)
        assert (np.diff(ours.scores, axis=1) <= 0).all()
        top1 = case.ours(case.decode_config(beam_size=BEAMS, n_best=1, alpha=length_penalty))
        np.testing.assert_array_equal(top1.tokens[:, 0], ours.tokens[:, 0])
        seen_lengths.update(_lengths(_rows(ours.tokens), case.config.eos_id).tolist())
        if case.forced_bos is not None:
            assert (ours.tokens[:, :, 0] == case.forced_bos).all() and (ours.token_scores[:, :, 0] == 0).all()
    assert len(seen_lengths) >= lengths, seen_lengths  # hypotheses ending at several lengths competed


@pytest.mark.parametrize("family", ["marian", "fsmt", "own"])
def test_n_best_matches_transformers(family, cases, parity_report):
    check_n_best(cases(family), family, parity_report)


# NLLB-200's and mBART-50's models and tokenizers (M2M-100's: the class below), their language codes forced first.
# mBART's random model runs every hypothesis to the length limit: one length, the scores still ranked and matched.
@pytest.mark.parametrize(("family", "lengths"), [("nllb", 3), ("mbart50", 1)])
def test_n_best_of_the_multilingual_models_matches_transformers(family, lengths, cases, parity_report):
    check_n_best(cases(family), family, parity_report, lengths)


def test_greedy_token_log_probs_match_transformers(cases, parity_report):
    """Greedy search's per-token log-probs: the log-softmax of the processed logits, as
    compute_transition_scores(..., normalize_logits=True) gives them; its score their sum."""
    case = cases("marian")
    out = case.generate(num_beams=1)
    ours = case.ours(case.decode_config(beam_size=1))
    token_diff, score_diff = _compare(case, ours, out, beams=False)
    parity_report("greedy per-token log-probs vs transformers", "marian", token_diff, SCORE_ATOL)
    parity_report("greedy scores (sum of log-probs) vs transformers", "marian", score_diff, SCORE_ATOL)
    lengths = _lengths(ours.tokens[:, 0], case.config.eos_id)
    assert len(set(lengths.tolist())) >= 2 and lengths.min() < MAX_LENGTH - 1, lengths  # sums of several lengths
    assert (ours.scores < 0).all()


# =============================================================================================================
# Target prefixes
# =============================================================================================================


def _prefixes(case: Case) -> list[list[int]]:
    """Row i's prefix: the first PREFIX_LENGTHS[i % 4] tokens of a reference translation of another sentence (a
    start the model would not choose itself), after the target language's code for a model that begins with it."""
    targets = default_pairs("valid", n=2 * len(SOURCES)).targets[len(SOURCES) :]
    code = 0 if case.forced_bos is None else 1  # the multilingual tokenizer puts the code first
    prefixes = []
    for i, text in enumerate(targets):
        n = PREFIX_LENGTHS[i % len(PREFIX_LENGTHS)]
        prefixes.append(case.tokenizer.encode(text, "target")[: code + n] if n else [])
    return prefixes


def check_prefixes(case: Case, beams: int, what: str, parity_report) -> None:
    """A batch of prefixes of 0 to 3 tokens against transformers decoding each sentence alone after its prefix."""
    prefixes = _prefixes(case)
    decode = case.decode_config(beam_size=beams, n_best=1)
    ours = case.ours(decode, prefixes=prefixes)
    plain = case.ours(decode)
    worst = [0.0, 0.0]
    for row, prefix in enumerate(prefixes):
        src = case.src[row : row + 1, : np.count_nonzero(case.src[row] != case.config.pad_id)]  # alone, unpadded
        out = case.generate(src=src, num_beams=beams, decoder_input_ids=[[case.config.start_id] + prefix])
        diffs = _compare(case, ours.row(row), out, beams=beams > 1, prompt=len(prefix))
        worst = [max(a, b) for a, b in zip(worst, diffs)]
    changed = []  # rows whose tokens after the prefix are not plain decoding's there
    for row, prefix in enumerate(prefixes):
        n = len(prefix)
        assert list(ours.tokens[row, 0, :n]) == prefix
        if n:  # the model read the prefix: other log-probs after it
            assert np.abs(ours.token_scores[row, 0, n:] - plain.token_scores[row, 0, n:]).max() > 1e-2, row
            changed.append(not np.array_equal(ours.tokens[row, 0, n:], plain.tokens[row, 0, n:]))
        else:  # a row without a prefix decodes as in a batch without prefixes
            np.testing.assert_array_equal(ours.tokens[row], plain.tokens[row])
    assert sum(changed) >= 2, changed
    search = "greedy" if beams == 1 else f"beam{beams}"
    parity_report("prefix per-token scores vs transformers", f"{what} {search}", worst[0], SCORE_ATOL)
    parity_report("prefix scores vs transformers", f"{what} {search}", worst[1], SCORE_ATOL)


# Marian only of the two: FSMT's cached decoder has no causal mask (it expects one new position a step), so
# transformers' generate reads an FSMT prompt longer than the start token with every prompt position seeing the
# others, and gives another model's scores for it; the multilingual case is M2M-100's (below).
@pytest.mark.parametrize("beams", [1, BEAMS], ids=["greedy", f"beam{BEAMS}"])
def test_prefixes_match_transformers(beams, cases, parity_report):
    check_prefixes(cases("marian"), beams, "marian", parity_report)


def test_prefixes_of_an_exported_model_of_this_project_match_transformers(cases, parity_report):
    check_prefixes(cases("own"), BEAMS, "own model exported", parity_report)


# =============================================================================================================
# Sampling: the warpers
# =============================================================================================================

WARPS = [  # (temperature, top_k, top_p)
    (1.0, 0, 0.9),
    (0.7, 10, 1.0),
    (1.3, 50, 0.8),
    (0.5, 0, 0.5),
    (2.0, 5, 0.95),
    (1.0, 1, 1.0),
    (1.5, 20, 0.3),
    (0.8, 3, 0.999),
]


def _random_scores(V: int, seed: int) -> np.ndarray:
    """Rows of scores with what the warpers must handle: ties, -inf entries, a row all tied, a row of five finite
    entries. (The all-tied row has V - 3 finite entries: with V of them, top_p 0.8 would put the cut exactly at a
    cumulative probability of 0.2, where float32 sums in another order decide either way.)"""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 3.0, (8, V)).astype(np.float32)
    x[0] = np.round(x[0])  # many ties
    x[1, rng.choice(V, V // 3, replace=False)] = -np.inf
    x[2] = np.round(x[2] * 2) / 2
    x[3] = 1.0
    x[3, :3] = -np.inf
    x[4, 5:] = -np.inf
    x[5, ::2] = np.round(x[5, ::2])
    x[6, rng.choice(V, 4, replace=False)] = -np.inf
    return x


@pytest.mark.parametrize("V", [100, 1000])
def test_warp_matches_transformers_warpers(V, parity_report):
    """`Sampler.warp` against transformers' warpers in their order: the same finite values, the same entries
    removed. Where the top-p cut falls among tied scores, both drop some of the equals: transformers those its
    sort (not a stable one) puts first, ours the lowest ids; there the kept values must be the same multiset and
    only tokens tied at the cut may differ."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    x = _random_scores(V, seed=V)
    worst, exact_rows, removing_rows = 0.0, 0, 0
    for temperature, top_k, top_p in WARPS:
        warpers = LogitsProcessorList()
        if temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p))
        theirs = warpers(None, torch.tensor(x)).numpy()
        sampler = Sampler(temperature=np.float32(temperature), top_p=np.float32(top_p), seed=np.uint32(0), top_k=top_k)
        ours = np.asarray(sampler.warp(x))
        for row in range(len(x)):
            kept, kept_theirs = np.isfinite(ours[row]), np.isfinite(theirs[row])
            values, values_theirs = np.sort(ours[row][kept]), np.sort(theirs[row][kept_theirs])
            assert values.shape == values_theirs.shape, (temperature, top_k, top_p, row)
            np.testing.assert_allclose(values, values_theirs, atol=WARP_ATOL)
            worst = max(worst, float(np.abs(values - values_theirs).max()))
            removing_rows += int((~kept & np.isfinite(x[row])).any())
            if np.array_equal(kept, kept_theirs):
                exact_rows += 1
                continue
            differ = kept != kept_theirs  # tokens tied with the smallest kept one, cut by top-p
            assert top_p < 1.0, (temperature, top_k, row)
            np.testing.assert_allclose(x[row][differ] / temperature, values_theirs[0], atol=WARP_ATOL)
    parity_report("sampling warp vs transformers' warpers", f"V={V}", worst, WARP_ATOL)
    assert exact_rows >= len(WARPS) * len(x) * 3 // 4, exact_rows  # only rows with ties at the cut may differ
    assert removing_rows >= len(WARPS) * len(x) // 2, removing_rows  # the warpers removed tokens: a real check


# =============================================================================================================
# A multilingual model: n-best, prefixes, sampling
# =============================================================================================================

SAMPLE_LENGTH = 6  # max_length of the sampling runs
SAMPLE_WARP = dict(temperature=1.3, top_k=20, top_p=0.9)
BATCH = 4  # sentences in the batch of the sampling runs
PER_SENTENCE = 150  # samples of each in the batch; the sentence alone: BATCH x as many (one program for both)


@pytest.fixture(scope="module")
def sampled(cases):
    """M2M-100's samples of SOURCES' longest sentence s: alone (BATCH * PER_SENTENCE samples), first in a batch of
    BATCH sentences (PER_SENTENCE samples each), third in it, and alone with another seed. s the longest: every run
    has the same shape, one program."""
    case = cases("m2m100")
    lengths = np.count_nonzero(case.src != case.config.pad_id, axis=1)
    s = int(np.argmax(lengths))
    others = [i for i in range(len(SOURCES)) if i != s][: BATCH - 1]
    cut = case.src[:, : lengths.max()]
    alone, batch, moved = cut[[s]], cut[[s, *others]], cut[[others[0], others[1], s, others[2]]]

    def run(src, n, seed=0):
        decode = case.decode_config(do_sample=True, n_best=n, sample_seed=seed, max_length=SAMPLE_LENGTH, **SAMPLE_WARP)
        return case.ours(decode, src)

    runs = dict(alone=run(alone, BATCH * PER_SENTENCE), batch=run(batch, PER_SENTENCE))
    runs.update(moved=run(moved, PER_SENTENCE), other_seed=run(alone, BATCH * PER_SENTENCE, seed=1))
    return case, dict(alone=alone, batch=batch), runs


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    """scipy's chi-square p-value of `counts` against `probs`, the bins of fewer than 5 expected draws merged into
    one (that one into the smallest other where it is still below 5)."""
    expected = probs / probs.sum() * counts.sum()
    big = expected >= 5
    observed, wanted = list(counts[big].astype(float)), list(expected[big])
    rest_observed, rest_wanted = float(counts[~big].sum()), float(expected[~big].sum())
    if rest_wanted >= 5:
        observed.append(rest_observed)
        wanted.append(rest_wanted)
    elif rest_wanted > 0 or rest_observed > 0:
        i = int(np.argmin(wanted))
        observed[i] += rest_observed
        wanted[i] += rest_wanted
    return float(stats.chisquare(observed, wanted).pvalue)


class TestM2M100:
    """M2M-100, its target language's code forced first (forced_bos_token_id)."""

    def test_n_best_matches_transformers(self, cases, parity_report):
        check_n_best(cases("m2m100"), "m2m100", parity_report)

    def test_prefixes_match_transformers(self, cases, parity_report):
        """The prefixes after the language code: transformers' forced BOS applies at the first step only, which a
        prompt passes; ours forces the prefix's code there."""
        check_prefixes(cases("m2m100"), BEAMS, "m2m100", parity_report)

    def test_top_k_1_sampling_is_greedy(self, cases, parity_report):
        """top_k=1 leaves one token to draw: transformers' greedy search's, whatever the seed and temperature;
        the per-token scores and scores are greedy's (the model's log-probs after the rules, not those of the
        warped scores, which are all 0 here)."""
        case = cases("m2m100")
        out = case.generate(num_beams=1)
        worst = [0.0, 0.0]
        for seed, temperature in ((0, 1.0), (7, 0.6)):
            decode = case.decode_config(do_sample=True, top_k=1, temperature=temperature, sample_seed=seed)
            worst = [max(a, b) for a, b in zip(worst, _compare(case, case.ours(decode), out, beams=False))]
        parity_report("top_k=1 sampling per-token vs greedy's", "m2m100", worst[0], SCORE_ATOL)
        parity_report("top_k=1 sampling scores vs greedy's", "m2m100", worst[1], SCORE_ATOL)

    def test_sampled_tokens_follow_transformers_distribution(self, sampled, parity_report):
        """The first free tokens (after the forced code) of 600 samples of one sentence against the softmax of
        transformers' own scores at that step under the same options (the rules, then temperature, top-k, top-p):
        chi-square, bins of fewer than 5 expected draws merged; no draw outside the warped support. The same
        counts against the unwarped distribution are rejected: the test tells the warping apart."""
        case, src, runs = sampled
        step = 1  # the code is forced at step 0
        out = case.generate(src=src["alone"], do_sample=True, max_length=SAMPLE_LENGTH, **SAMPLE_WARP)
        probs = torch.softmax(out.scores[step][0].double(), dim=-1).numpy()
        drawn = runs["alone"].tokens[0, :, step]
        counts = np.bincount(drawn, minlength=len(probs))
        assert counts[probs == 0].sum() == 0, np.flatnonzero(counts * (probs == 0))
        p_value = _chi_square(counts, probs)
        parity_report("sampled tokens chi-square p (> 1e-3)", "m2m100", p_value, 1e-3)
        assert p_value > 1e-3, p_value
        assert np.count_nonzero(counts) >= 10  # a distribution, not a near-certainty
        plain = case.generate(src=src["alone"], do_sample=True, max_length=SAMPLE_LENGTH, temperature=1.0, top_k=0)
        unwarped = torch.softmax(plain.scores[step][0].double(), dim=-1).numpy()
        assert np.count_nonzero(unwarped) > 2 * np.count_nonzero(probs)
        assert _chi_square(counts, unwarped) < 1e-6

    def test_sample_depends_on_seed_and_sentence_only(self, sampled, parity_report):
        """A sentence's k-th sample is the same alone, first in a batch and third in it; another seed gives other
        samples. Their per-token scores are the model's log-probs after the rules (the code forced first: 0),
        teacher-forced through transformers' model; their scores the sums."""
        case, src, runs = sampled
        alone, batch, moved = runs["alone"], runs["batch"], runs["moved"]
        mine = alone.tokens[0, :PER_SENTENCE]
        np.testing.assert_array_equal(batch.tokens[0], mine)
        np.testing.assert_array_equal(moved.tokens[2], mine)
        np.testing.assert_array_equal(moved.tokens[[0, 1, 3]], batch.tokens[[1, 2, 3]])
        # The same sentences in other rows: the same scores up to the rounding of other batch shapes.
        np.testing.assert_allclose(batch.scores[0], alone.scores[0, :PER_SENTENCE], atol=1e-5)
        # Random draws: samples differ from each other and from another seed's.
        assert len({tuple(s) for s in mine}) >= PER_SENTENCE // 2
        other = runs["other_seed"].tokens[0]
        assert np.mean([not np.array_equal(a, b) for a, b in zip(alone.tokens[0], other)]) > 0.5

        # The first samples of each sentence, teacher-forced.
        inputs = np.repeat(src["batch"], 4, axis=0)
        tokens, token_scores = _rows(batch.tokens[:, :4]), _rows(batch.token_scores[:, :4])
        start = np.full((len(tokens), 1), case.config.start_id)
        with torch.no_grad():
            logits = case.theirs(
                input_ids=torch.tensor(inputs, dtype=torch.long),
                attention_mask=torch.tensor(inputs != case.config.pad_id, dtype=torch.long),
                decoder_input_ids=torch.tensor(np.concatenate([start, tokens[:, :-1]], axis=1), dtype=torch.long),
            ).logits
        expected = np.take_along_axis(torch.log_softmax(logits, dim=-1).numpy(), tokens[:, :, None], axis=2)[..., 0]
        assert (tokens[:, 0] == case.forced_bos).all()
        expected[:, 0] = 0.0  # the code, forced
        real = ~_after_end(tokens, case.config.eos_id)
        diff = float(np.abs(np.where(real, token_scores - expected, 0)).max())
        parity_report("sampled per-token log-probs vs teacher-forced", "m2m100", diff, SCORE_ATOL)
        assert diff <= SCORE_ATOL
        assert (token_scores[~real] == 0).all()
        np.testing.assert_allclose(_rows(batch.scores[:, :4]), token_scores.sum(axis=1), atol=1e-5)
