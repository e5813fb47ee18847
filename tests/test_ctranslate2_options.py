"""CTranslate2's decoding and scoring options against this project's, on the very same float32 weights: a tiny random
MarianMTModel (tests/helpers/pretrained.py, EOS raised so that outputs end at several lengths) that this project
imports (`hub.read_pretrained`) and CTranslate2 converts (its TransformersConverter), once for the module.

Proven here:
- n-best lists: `translate_batch(beam_size=4, num_hypotheses=4, length_penalty=alpha, return_scores=True)` gives
  the hypotheses, token for token and in the same order, of `decoding.decoder` with transformers' rules and
  `DecodeConfig(beam_size=4, n_best=4, alpha=alpha, early_stopping="true")`, alpha 1 and 0.6; both scores are
  log P / length ** alpha with the length counting EOS (CTranslate2 counts it whether or not `return_end_token`
  shows it).
- `target_prefix`: the same hypotheses as this project's `prefixes=`; the prefix's tokens are forced and scored 0 in
  both; CTranslate2's length counts the prefix, this project's (transformers') does not.
- `score_batch`: the tokens `scoring.score_pairs` scores (the target's and EOS; the decoder's start token is not
  scored) and their log-probs.

One difference runs through all three: CTranslate2 drops Marian's <pad> from the vocabulary (its converter removes
the row that transformers adds for the decoder's start), so its log-probs are the model's softmax over the
vocabulary without <pad>, where this project's (and transformers') beam search and scoring take the softmax over the
whole vocabulary and then ban <pad>. Per token the two differ by -log(1 - P(<pad>)); each is checked against its
own softmax of the reference logits (the transformers model's, in float64), and the gap is checked to be real.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from jax_transformer.data.default_task import default_pairs
from jax_transformer.decoding import scoring
from jax_transformer.decoding.decoders import decoder
from jax_transformer.interop import hub
from jax_transformer.settings.config import DecodeConfig

ctranslate2 = pytest.importorskip("ctranslate2")
pytest.importorskip("torch")
pytest.importorskip("transformers")

PAIRS = default_pairs("valid", n=6)
BEAMS = 4
MAX_TOKENS = 64  # the longest output, EOS included (the model's max_len); nothing here comes near it
# Per token: a log-prob is a logit minus the logsumexp of logits, and float32 logits of two implementations of these
# tiny models agree within 1e-5 (the bound parity_tests/test_pretrained.py holds this project's to against
# transformers'), so two computations of one log-prob agree within 2e-5; a sum of n of them within n times that.
# Measured: below 1e-6 (CTranslate2 on CPU in float32, this project's search and the float64 reference).
ATOL_TOKEN = 2e-5
# Added to EOS's logit: a random model's outputs never end. (What tests.helpers.pretrained.end_at_various_lengths
# finds for these sentences, 2.57, without running transformers' generate for it.)
EOS_RAISE = 2.5


@dataclasses.dataclass(frozen=True)
class Engines:
    """The one model as both engines hold it, and the transformers model they were made from."""

    config: Any
    params: Any
    tokenizer: Any
    translator: Any  # ctranslate2.Translator, float32 on the CPU
    reference: Any  # the transformers MarianMTModel (eager), for reference logits
    sources: list[list[int]]  # each sentence's ids, EOS last
    src: np.ndarray  # (B, S) the same, right-padded

    def pieces(self, ids) -> list[str]:
        return [self.tokenizer.piece(int(i)) for i in ids]


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Engines:
    import torch

    from tests.helpers.pretrained import marian_tokenizer_files, tiny_marian

    root = tmp_path_factory.mktemp("ctranslate2_options")
    folder = root / "hf"
    sizes = marian_tokenizer_files(folder)
    model = tiny_marian(sizes)
    with torch.no_grad():  # EOS made likely enough that hypotheses end, at several lengths (test_n_best_lists checks)
        model.final_logits_bias[0, sizes["eos"]] += EOS_RAISE
    model.save_pretrained(folder)
    ctranslate2.converters.TransformersConverter(str(folder)).convert(str(root / "ct2"))
    imported = hub.read_pretrained(folder)
    config, tokenizer = imported.config, imported.tokenizer
    sources = [tokenizer.encode(s) + [config.eos_id] for s in PAIRS.sources]
    src = np.full((len(sources), max(map(len, sources))), config.pad_id, np.int32)
    for row, ids in enumerate(sources):
        src[row, : len(ids)] = ids
    translator = ctranslate2.Translator(str(root / "ct2"), device="cpu", compute_type="float32", intra_threads=1)
    return Engines(config, imported.params, tokenizer, translator, model, sources, src)


def reference_log_probs(e: Engines, rows: list[int], outputs: list[list[int]]) -> list[tuple[np.ndarray, ...]]:
    """For each output (teacher forcing on the sources of `rows`), from the transformers model's logits in float64:
    its tokens' log-probs over the whole vocabulary (this project's), over the vocabulary without <pad>
    (CTranslate2's), and the best log-prob without <pad> at each position."""
    import torch

    pad = e.config.pad_id
    src = torch.tensor(e.src[rows], dtype=torch.long)
    tgt = np.full((len(outputs), max(map(len, outputs))), pad, np.int64)
    for row, ids in enumerate(outputs):
        tgt[row, : len(ids)] = [e.config.start_id, *ids[:-1]]  # Marian's decoder starts from <pad>
    with torch.no_grad():
        logits = e.reference(
            input_ids=src, attention_mask=(src != pad).long(), decoder_input_ids=torch.tensor(tgt)
        ).logits.double()
    full = torch.log_softmax(logits, dim=-1).numpy()
    logits[..., pad] = -torch.inf
    without_pad = torch.log_softmax(logits, dim=-1).numpy()
    out = []
    for row, ids in enumerate(outputs):
        at = np.arange(len(ids))
        out.append((full[row, at, ids], without_pad[row, at, ids], without_pad[row, at].max(axis=-1)))
    return out


def ours_decoder(e: Engines, alpha: float):
    """transformers' rules as CTranslate2 runs them: CTranslate2's beam search (with a length penalty) stops a
    sentence once beam_size * patience (1) hypotheses are finished, as transformers' early_stopping=True does (with
    early_stopping "false" ours searches on while a live hypothesis might still beat the worst finished one, and the
    n-best lists differ); it never produces <pad> (not in its vocabulary), which ours bans."""
    decode = DecodeConfig(
        rules="transformers",
        beam_size=BEAMS,
        n_best=BEAMS,
        alpha=alpha,
        early_stopping="true",
        banned=str(e.config.pad_id),
        max_length=MAX_TOKENS + 1,  # (counting the decoder's start token)
    )
    return decoder(e.config, decode, e.src.shape[1])


def translate(e: Engines, alpha: float, prefixes: list[list[int]] | None = None, end_token: bool = True):
    """CTranslate2's n-best lists of the sentences, by the same rules as `ours_decoder`'s."""
    return e.translator.translate_batch(
        [e.pieces(ids) for ids in e.sources],
        None if prefixes is None else [e.pieces(p) for p in prefixes],
        beam_size=BEAMS,
        num_hypotheses=BEAMS,
        length_penalty=alpha,
        patience=1.0,
        max_decoding_length=MAX_TOKENS,
        min_decoding_length=0,  # its default 1 would ban EOS at the first step; transformers' min_length is 0
        return_scores=True,
        return_end_token=end_token,  # show EOS at the end of the hypotheses, as ours have it
    )


def hypotheses(e: Engines, decoded, row: int) -> list[list[int]]:
    """Sentence `row`'s hypotheses from a `Decoded`, best first, as lists of ids (EOS included, padding left out)."""
    return [[int(i) for i in ids if i != e.config.pad_id] for ids in decoded.tokens[row]]


@pytest.mark.parametrize("alpha", [1.0, 0.6])
def test_n_best_lists(engines, alpha):
    """translate_batch(beam_size=4, num_hypotheses=4, length_penalty=alpha): the same 4 hypotheses in the same
    order as ours; its score is sum(log-probs without <pad>) / length ** alpha, ours sum(log-probs) / length **
    alpha, the length counting EOS in both."""
    e = engines
    ours = ours_decoder(e, alpha)(e.params, e.src)
    theirs = translate(e, alpha)
    assert ours.found.all()
    rows = [r for r in range(len(e.sources)) for _ in range(BEAMS)]
    outputs = [h for r in range(len(e.sources)) for h in hypotheses(e, ours, r)]
    reference = reference_log_probs(e, rows, outputs)
    assert all(h[-1] == e.config.eos_id for h in outputs)  # all end with EOS: the lengths below count it
    assert len({len(h) for h in outputs}) >= 3  # several lengths: the length's definition is put to the test
    gaps, worst = [], 0.0
    for r, result in enumerate(theirs):
        assert [e.pieces(h) for h in hypotheses(e, ours, r)] == result.hypotheses, f"sentence {r}"
        for k, score in enumerate(result.scores):
            ids, (log_p, log_p_without_pad, _) = outputs[r * BEAMS + k], reference[r * BEAMS + k]
            n = len(ids)
            tolerance = n * ATOL_TOKEN
            # Ours: each token's log-prob over the whole vocabulary, the score their sum over n ** alpha.
            np.testing.assert_allclose(ours.token_scores[r, k, :n], log_p, rtol=0, atol=ATOL_TOKEN)
            assert not ours.token_scores[r, k, n:].any()
            assert abs(ours.scores[r, k] * n**alpha - log_p.sum()) <= tolerance
            # CTranslate2's: the log-probs without <pad>, over the same n ** alpha.
            worst = max(worst, abs(score * n**alpha - log_p_without_pad.sum()))
            assert abs(score * n**alpha - log_p_without_pad.sum()) <= tolerance, (r, k)
            gaps.append(score - ours.scores[r, k])
        assert result.scores == sorted(result.scores, reverse=True)
        assert np.all(np.diff(ours.scores[r]) <= 0)
    print(f"[ctranslate2] n-best, alpha {alpha}: sum of log-probs differs by at most {worst:.2e}")
    # The vocabularies differ for real: every CTranslate2 score is higher by P(<pad>)'s share, well above noise.
    assert min(gaps) > 10 * ATOL_TOKEN, gaps
    # Without return_end_token EOS is left out of the hypotheses, not out of the length: the same scores.
    hidden = translate(e, alpha, end_token=False)
    assert [h.hypotheses for h in hidden] == [[ids[:-1] for ids in t.hypotheses] for t in theirs]
    np.testing.assert_allclose([h.scores for h in hidden], [t.scores for t in theirs], rtol=1e-6, atol=0)


def test_target_prefix(engines):
    """translate_batch(target_prefix=...) with length_penalty 1: the 4 hypotheses ours gives with the same prefixes
    (prefixes of 1 to 3 tokens; the unprefixed search starts none of its hypotheses so). The prefix's tokens are
    scored 0 in both; CTranslate2 divides by the whole length (prefix and EOS), ours by the tokens after the prefix,
    so the two may rank the same 4 hypotheses differently: they are compared as sets, each ranking by its own rule.

    CTranslate2 also cuts short a hypothesis that ends just after the prefix unless EOS is the best token there
    (it gives that EOS a log-prob of -1e10, decoding.cc's update_sample_with_prefix): such a hypothesis is found by
    both, but its CTranslate2 score is about -1e10 / length."""
    e = engines
    eos = e.config.eos_id
    prefixes = [e.tokenizer.encode(t, side="target")[: 1 + i % 3] for i, t in enumerate(PAIRS.targets)]
    search = ours_decoder(e, 1.0)
    plain = search(e.params, e.src)
    ours = search(e.params, e.src, prefixes=prefixes)
    theirs = translate(e, 1.0, prefixes)
    assert ours.found.all()
    rows = [r for r in range(len(e.sources)) for _ in range(BEAMS)]
    outputs = [h for r in range(len(e.sources)) for h in hypotheses(e, ours, r)]
    reference = reference_log_probs(e, rows, outputs)
    cut_short, worst = 0, 0.0
    for r, (prefix, result) in enumerate(zip(prefixes, theirs)):
        P = len(prefix)
        found = hypotheses(e, ours, r)
        # The prefix changed the search: no unprefixed hypothesis starts with it.
        assert all(h[:P] != prefix for h in hypotheses(e, plain, r)), f"sentence {r}"
        assert all(h[:P] == prefix and h[-1] == eos for h in found)
        assert sorted(e.pieces(h) for h in found) == sorted(result.hypotheses), f"sentence {r}"
        for k, ids in enumerate(found):
            n, (log_p, log_p_without_pad, best) = len(ids), reference[r * BEAMS + k]
            assert not ours.token_scores[r, k, :P].any()  # the prefix scored 0
            np.testing.assert_allclose(ours.token_scores[r, k, P:n], log_p[P:], rtol=0, atol=ATOL_TOKEN)
            assert abs(ours.scores[r, k] * (n - P) - log_p[P:].sum()) <= n * ATOL_TOKEN
            score = result.scores[result.hypotheses.index(e.pieces(ids))]
            # Cut short: the prefix and EOS, where EOS was not the best token (by more than the noise).
            cut = n == P + 1 and log_p_without_pad[P] < best[P] - ATOL_TOKEN
            assert (score < -1e9) == cut, (r, ids, score)
            if cut:
                cut_short += 1
                continue
            worst = max(worst, abs(score * n - log_p_without_pad[P:].sum()))
            assert abs(score * n - log_p_without_pad[P:].sum()) <= n * ATOL_TOKEN, (r, k)
        assert result.scores == sorted(result.scores, reverse=True)
        assert np.all(np.diff(ours.scores[r]) <= 0)
    print(f"[ctranslate2] target_prefix: sums differ by at most {worst:.2e}; {cut_short} hypotheses cut short")
    assert cut_short  # the case the docstring describes is among these


def test_score_batch(engines):
    """score_batch: the tokens score_pairs scores (the target's, then EOS; the decoder's start token is not scored)
    and each one's log-prob, CTranslate2's over the vocabulary without <pad>, ours over the whole vocabulary."""
    e = engines
    ours = scoring.score_pairs(e.params, e.config, e.tokenizer, list(PAIRS.sources), list(PAIRS.targets))
    targets = [e.tokenizer.encode(t, side="target") for t in PAIRS.targets]
    theirs = e.translator.score_batch([e.pieces(ids) for ids in e.sources], [e.pieces(ids) for ids in targets])
    reference = reference_log_probs(e, list(range(len(targets))), [s.tokens for s in ours])
    worst = 0.0
    for target, mine, result, (log_p, log_p_without_pad, _) in zip(targets, ours, theirs, reference):
        assert mine.tokens == [*target, e.config.eos_id]
        assert result.tokens == e.pieces(mine.tokens)  # no start token; EOS last
        n = len(mine.tokens)
        np.testing.assert_allclose(mine.token_scores, log_p, rtol=0, atol=ATOL_TOKEN)
        np.testing.assert_allclose(result.log_probs, log_p_without_pad, rtol=0, atol=ATOL_TOKEN)
        assert abs(mine.score - log_p.sum()) <= n * ATOL_TOKEN
        assert abs(sum(result.log_probs) - log_p_without_pad.sum()) <= n * ATOL_TOKEN
        worst = max(worst, float(np.abs(np.array(result.log_probs) - log_p_without_pad).max()))
        # The difference is -log(1 - P(<pad>)) at every token: positive and real.
        assert np.all(np.array(result.log_probs) - np.array(mine.token_scores) > 10 * ATOL_TOKEN)
    print(f"[ctranslate2] score_batch: per-token log-probs differ by at most {worst:.2e}")
