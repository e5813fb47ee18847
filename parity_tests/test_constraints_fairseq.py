"""Lexical constraints against fairseq 0.12.2's `LexicallyConstrainedBeamSearch` itself (its `search.py` and
`token_generation_constraints.py` from the registry's sdist, driven by tests/helpers/fairseq_constraints.py's copy
of `SequenceGenerator._generate`'s logic) on the same weights: the saved trained model's sources, beam 4, the
twin's log-probs for fairseq. Skipped, with the reason, where the sdist cannot be downloaded.

The rules made to coincide: ours are `rules="transformers"` with `early_stopping="true"` and `alpha` 1, fairseq's
lenpen 1: both score a finished hypothesis log P / (tokens, EOS included) ** 1, rank live ones by log P, and stop a
sentence once it has K finished ones; PAD and BOS are never produced (our `banned`, fairseq's own PAD ban and its
token_indices_to_suppress). Lengths: fairseq max_len = the model's max_len - 1 (its last step EOS only), ours
max_length = max_len + 1; they differ only at the limit, which the exact rows never reach (checked).

Rows "distinct": phrases whose tokens are all different, within a phrase and across a row's phrases. There a
mismatch in the middle of a phrase falls back the same way in both (fairseq's trie to its root, ours to the longest
prefix ending the hypothesis: the phrase's first token or nothing), except on the phrase's own first token (fairseq:
the root, ours: that token matched) and in ordered phrases after the first one (fairseq then starts over from the
first phrase). These, fairseq's proposing the first token of every phrase at every step (met or in progress;
ordered: the first phrase's) and its unstable sort of ties may change a search's path; on these rows none does
(docs/decoding.md gives how often one does over more sources): the tokens must be identical, the scores agree
within test_decoding_parity.py's SCORE_ATOL (float32 reassociation only).

Rows "overlapping": a phrase inside another ([21, 60] and [21]) or a phrase with a repeated token (240 45 240 128,
whose partial match fairseq's trie loses on "240 45 240 45"). fairseq counts each output token toward one phrase
only and resets its trie on a mismatch; ours matches each phrase wherever it occurs. So fairseq's output must hold
every phrase by our rule too (it was open to our search); how often the tokens agree, and our score minus
fairseq's where they differ, is printed (beam search is not exact: either may find the better output).

The phrases are pieces of the first eight sources' plain outputs (21 60, 21 87, 21 46 240 45 240 128, ... 94 21 90):
tokens the model would place elsewhere."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jax_transformer.decoding import decoders
from jax_transformer.decoding.schedule import Whole
from jax_transformer.settings.config import DecodeConfig
from parity_tests.test_decoding_parity import SCORE_ATOL, one_torch_thread  # noqa: F401 (an autouse fixture)
from tests.helpers import fairseq_constraints
from tests.helpers.saved import load_saved_model
from tests.helpers.twins import t, torch_twin

BEAMS = 4
DISTINCT = [[[87]], [[240, 128], [21]], [[21, 46]], [[240, 65], [21]], [[94, 21]], [[21], [60]], [[60]], [[21], [128]]]
OVERLAPPING = [[[21, 87], [87]], [[21, 60], [21]], [[240, 45, 240, 65]], [[21, 60], [60]],
               [[240, 45, 240, 128]], [[21, 60], [21]], [[45, 240, 45]], [[21, 60], [21]]]  # fmt: skip


@pytest.fixture(scope="module")
def fairseq_modules(request):
    """fairseq's search modules, the sdist kept in $FAIRSEQ_SDIST_DIR, else pytest's cache, else ~/.cache; skip
    where it cannot be downloaded."""
    cache = getattr(request.config, "cache", None)  # None with -p no:cacheprovider
    folder = os.environ.get(fairseq_constraints.CACHE_ENV) or (cache.mkdir("fairseq-sdist") if cache else None)
    try:
        return fairseq_constraints.fairseq_search_modules(folder)
    except fairseq_constraints.Unavailable as e:
        pytest.skip(f"fairseq {fairseq_constraints.VERSION}'s sdist cannot be had: {e}")


def _holds(tokens, phrases, ordered: bool) -> bool:
    """Whether `tokens` hold every phrase by our rule: each anywhere (ordered: each after the previous one's end)."""
    start = 0
    for phrase in phrases:
        ends = [i + len(phrase) for i in range(start, len(tokens) - len(phrase) + 1)
                if tokens[i : i + len(phrase)] == phrase]  # fmt: skip
        if not ends:
            return False
        start = min(ends) if ordered else 0
    return True


@pytest.mark.slow
@pytest.mark.parametrize("order", ["unordered", "ordered"])
def test_constrained_search_matches_fairseq(order, fairseq_modules, parity_report):
    saved = load_saved_model("trained_tiny")
    config, params = saved.config, saved.params
    src = np.concatenate([saved.sources[:8]] * 2)  # (16, S): each source with distinct, then overlapping phrases
    phrases = DISTINCT + OVERLAPPING
    decode = DecodeConfig(rules="transformers", beam_size=BEAMS, n_best=BEAMS, alpha=1.0, early_stopping="true",
                          banned=f"{config.pad_id},{config.bos_id}", constraint_order=order)  # fmt: skip
    ours = decoders.decoder(config, decode, src.shape[1])(params, src, Whole(), None, phrases, None)
    theirs = fairseq_constraints.generate(
        fairseq_modules, torch_twin(config, params), t(src), phrases, beam_size=BEAMS, ordered=order == "ordered",
        len_penalty=1.0, max_len_b=config.max_len, suppress=(config.bos_id,),
    )  # fmt: skip
    assert ours.found[:, 0].all()
    same, gains, agree = [], [], 0
    for row in range(len(src)):
        mine = [int(i) for i in ours.tokens[row, 0] if i != config.pad_id]
        best = theirs[row][0]
        if row < len(DISTINCT):
            assert not best.at_limit and len(mine) < config.max_len, f"row {row} reached the length limit"
            assert mine == best.tokens, f"row {row} ({phrases[row]}): ours {mine}, fairseq's {best.tokens}"
            same.append(abs(float(ours.scores[row, 0]) - best.score))
        elif mine == best.tokens:
            assert abs(float(ours.scores[row, 0]) - best.score) <= SCORE_ATOL
            agree += 1
        else:
            assert _holds(best.tokens[:-1], phrases[row], order == "ordered"), f"row {row}: fairseq's output"
            gains.append(float(ours.scores[row, 0]) - best.score)
    assert max(same) <= SCORE_ATOL
    parity_report("fairseq constrained search: scores", order, max(same), SCORE_ATOL)
    print(
        f"[fairseq] {order}: distinct rows {len(same)}/{len(same)} identical; overlapping rows {agree}/"
        f"{len(OVERLAPPING)} identical, elsewhere ours minus fairseq's score {[round(g, 4) for g in gains]}"
    )
