"""Target prefixes and n-best lists against the PyTorch twin: `decoders.decoder(config, DecodeConfig(...), width)`
with `prefixes` and `n_best` against `torch_reference.decoding`'s searches with the same arguments, on the same
weights, greedy and beam 4 (its 3 best), every batch holding prefixes of several lengths and rows without one.

Tokens and `found` must be identical; scores and per-token log-probs agree within test_decoding_parity.py's
SCORE_ATOL (its docstring: float32 reassociation only). Both outputs are also held to the rules themselves, in
numpy: a prefix's tokens come first with log-prob 0, the per-token log-probs are the model's (a teacher-forced
forward pass of the twin), and a score is their sum over the GNMT penalty of the tokens generated after the
prefix. Against plain decoding (the same decoder without prefixes): a row without a prefix decodes as it does
there, a row with one does not, and the n-best hypotheses are distinct and best first.

The model is the saved trained one (tests/data: peaked distributions, EOS where sentences end, so hypotheses of
many lengths compete, and some run to their length limit, which counts the prefix), on two batches of its
sources. A row's prefix is the start of another row's plain greedy output: a plausible continuation to force, that
the model would not choose itself. Random models would do less here: this one's random weights are near-uniform
over its 256 tokens (beam candidates a hair apart) and other configs cost programs to compile, most of this file's
time; the two batches share one Flax program per search (each batch whole; prefixes are arguments, so plain
decoding reuses it too).
"""

from __future__ import annotations

import numpy as np
import pytest

from jax_transformer.decoding import decoders
from jax_transformer.decoding.schedule import Whole
from jax_transformer.settings.config import DecodeConfig
from parity_tests.test_decoding_parity import (  # noqa: F401 (one_torch_thread: an autouse fixture)
    MIN_MARGIN,
    SCORE_ATOL,
    explain_mismatch,
    one_torch_thread,
    teacher_forced_log_probs,
)
from tests.helpers.saved import load_saved_model
from tests.helpers.twins import t, torch_twin
from torch_reference import decoding as torch_decoding

BEAMS, N_BEST, ALPHA = 4, 3, 0.6
ROWS = 16  # sentences a batch
PREFIX_LENGTHS = (0, 1, 2, 3, 4, 5, 1, 2)  # a prefix of PREFIX_LENGTHS[i % 8] tokens for row i of the first batch


@pytest.fixture(scope="module")
def saved():
    return load_saved_model("trained_tiny")


@pytest.fixture(scope="module", params=[0, 1], ids=["batch0", "batch1"])
def case(request, saved):
    """(name, config, Flax params, twin, sources, prefixes) of the saved model's batch `request.param`."""
    config, params, batch = saved.config, saved.params, request.param
    src = saved.sources[batch * ROWS : (batch + 1) * ROWS]
    plain = plain_decoding(config, params, src, DecodeConfig(beam_size=1)).tokens[:, 0]
    prefixes = []
    for row in range(ROWS):
        # The output of the next row from row + ROWS / 2 on that starts otherwise, cut before its EOS.
        others = (plain[(row + k) % ROWS] for k in range(ROWS // 2, ROWS // 2 + ROWS))
        other = next(o for o in others if o[0] != plain[row][0])
        ids = [int(i) for i in other if i not in (config.eos_id, config.pad_id)]
        prefixes.append(ids[: PREFIX_LENGTHS[(row + 3 * batch) % len(PREFIX_LENGTHS)]] or None)
    return f"trained tiny {batch}", config, params, torch_twin(config, params), src, prefixes


def plain_decoding(config, params, src, decode: DecodeConfig, prefixes=None) -> decoders.Decoded:
    return decoders.decoder(config, decode, src.shape[1])(params, src, Whole(), prefixes)


def twin_decoding(model, src, decode: DecodeConfig, prefixes, use_cache: bool, n_best):
    options = dict(n_best=n_best, prefixes=prefixes, use_cache=use_cache, min_len=0)
    if decode.beam_size == 1:
        return torch_decoding.greedy_search(model, t(src), **options)
    return torch_decoding.beam_search(model, t(src), beam_size=decode.beam_size, alpha=decode.alpha, **options)


def check_rules(model, src, found, prefixes, alpha: float, what: str) -> None:
    """The rules, on one framework's output (numpy arrays of a Decoded): prefix first and scored 0, per-token
    log-probs the model's, score = their sum / ((5 + generated) / 6) ** alpha."""
    cfg = model.cfg
    B, n, L = found.tokens.shape
    # A sentence stops with its K slots full, or at its length limit, where the K best candidates finish.
    assert found.found.all(), f"{what}: an empty slot"
    lengths = [len(p or []) for p in prefixes]
    forced = np.arange(L)[None, :] < np.array(lengths)[:, None]  # (B, L) the prefixes' positions
    for row, p in enumerate(prefixes):
        assert (found.tokens[row, :, : len(p or [])] == np.array(p or [], np.int64)).all(), f"{what}: row {row}"
    assert (found.token_scores[forced[:, None, :].repeat(n, 1)] == 0).all(), f"{what}: a prefix token scored"
    # The model's log-probs of the generated tokens (PAD and BOS never produced, as the searches see them).
    flat_tokens = found.tokens.reshape(B * n, L)
    lp = teacher_forced_log_probs(model, np.repeat(src, n, axis=0), flat_tokens)  # (B * n, L, V)
    chosen = np.take_along_axis(lp, flat_tokens[:, :, None], axis=2)[:, :, 0].reshape(B, n, L)
    real = (found.tokens != cfg.pad_id) & ~forced[:, None, :]
    diff = float(np.max(np.abs(np.where(real, chosen - found.token_scores, 0.0))))
    assert diff <= SCORE_ATOL, f"{what}: per-token log-probs are not the model's (max diff {diff:.1e})"
    assert (found.token_scores[found.tokens == cfg.pad_id] == 0).all(), f"{what}: a score after the end"
    generated = real.sum(axis=2)  # (B, n) tokens after the prefix, EOS included
    expected = found.token_scores.sum(axis=2) / decoders.length_penalties(L, alpha)[generated]
    diff = float(np.max(np.abs(expected - found.scores)))
    assert diff <= SCORE_ATOL, f"{what}: scores are not log P / penalty(generated) (max diff {diff:.1e})"


def greedy_margin_after_prefix(model, src, tokens, prefixes) -> float:
    """The smallest gap between the chosen token's log-prob and the runner-up's along greedy paths, past the
    forced prefixes (a choice there is no choice)."""
    lp = teacher_forced_log_probs(model, src, tokens)
    top2 = -np.sort(-lp, axis=-1)[:, :, :2]
    chosen = (tokens != model.cfg.pad_id) & (
        np.arange(tokens.shape[1]) >= np.array([len(p or []) for p in prefixes])[:, None]
    )
    return float(np.min((top2[:, :, 0] - top2[:, :, 1])[chosen]))


@pytest.mark.parametrize("beams", [1, BEAMS], ids=["greedy", f"beam{BEAMS}"])
def test_prefixes_and_n_best_identical(case, beams, parity_report):
    name, config, params, model, src, prefixes = case
    n = 1 if beams == 1 else N_BEST
    decode = DecodeConfig(beam_size=beams, n_best=n, alpha=ALPHA)
    alpha = 0.0 if beams == 1 else ALPHA  # greedy's score is log P itself
    flax = plain_decoding(config, params, src, decode, prefixes)
    assert flax.tokens.shape == (len(src), n, decoders.output_length(src.shape[1], config))
    check_rules(model, src, flax, prefixes, alpha, "flax")
    if beams == 1:
        margin = greedy_margin_after_prefix(model, src, flax.tokens[:, 0], prefixes)
        assert margin > MIN_MARGIN, f"near-tie on the greedy path (margin {margin:.1e}): choose other prefixes"

    for use_cache in (False, True):
        search = "greedy" if beams == 1 else f"beam {beams} n-best {n}"
        what = f"{search} + prefixes vs torch {'cached' if use_cache else 'uncached'}"
        twin = decoders.Decoded(
            *(x.cpu().numpy() for x in twin_decoding(model, src, decode, prefixes, use_cache, n_best=n))
        )
        for k in range(n):
            if not np.array_equal(flax.tokens[:, k], twin.tokens[:, k]):
                pytest.fail(
                    f"{what}: hypothesis {k} differs. "
                    + explain_mismatch(model, src, flax.tokens[:, k], twin.tokens[:, k])
                )
        assert np.array_equal(flax.found, twin.found)
        diff = max(
            float(np.max(np.abs(flax.scores - twin.scores))),
            float(np.max(np.abs(flax.token_scores - twin.token_scores))),
        )
        parity_report(what, name, diff, SCORE_ATOL)
        assert diff <= SCORE_ATOL
        # Existing callers' return value (n_best=None): the best hypothesis alone, the same one.
        tokens, scores = twin_decoding(model, src, decode, prefixes, use_cache, n_best=None)
        assert np.array_equal(tokens.cpu().numpy(), twin.tokens[:, 0])
        assert np.array_equal(scores.cpu().numpy(), twin.scores[:, 0])
    check_rules(model, src, twin, prefixes, alpha, "twin")

    # What the options change: plain decoding by the same program, without prefixes.
    plain = plain_decoding(config, params, src, decode)
    with_prefix = np.array([bool(p) for p in prefixes])
    same = np.all(flax.tokens == plain.tokens, axis=(1, 2))
    assert same[~with_prefix].all(), "a row without a prefix must decode as without any prefix in its batch"
    assert np.array_equal(flax.scores[~with_prefix], plain.scores[~with_prefix])
    # Each prefix starts otherwise than its row's plain output, and its tokens score 0 instead of their log-probs.
    assert not same[with_prefix].any(), f"a prefix left rows {np.flatnonzero(same & with_prefix)} as they were"
    assert (flax.scores[with_prefix] != plain.scores[with_prefix]).all()
    if n > 1:
        # n distinct hypotheses, best first, the first being the one plain beam search returns.
        assert (np.diff(flax.scores, axis=1) <= 0).all()
        for row in range(len(src)):
            assert len({tuple(h) for h in flax.tokens[row]}) == n, f"row {row}: repeated hypotheses"
        best_tokens, best_scores = decoders.beam_search(
            params, config, src, beam_size=beams, alpha=ALPHA, schedule=Whole()
        )
        assert np.array_equal(plain.tokens[:, 0], best_tokens) and np.array_equal(plain.scores[:, 0], best_scores)
