"""Lexical constraints against the PyTorch twin: `decoders.decoder(...)` with phrases that must appear (unordered
and ordered) and phrases that must not, against `torch_reference.decoding.beam_search` with the same arguments
(its `_Constrained`: the same rules, read off each hypothesis's tokens instead of carried as arrays), on the saved
trained model's sources, beam 4 (its 3 best). Tokens and `found` must be identical; scores agree within
test_decoding_parity.py's SCORE_ATOL (float32 reassociation only). The phrases of a row are pieces of other rows'
plain outputs: tokens the model would place elsewhere; some rows have none."""

from __future__ import annotations

import numpy as np
import pytest

from jax_transformer.decoding import decoders
from jax_transformer.decoding.schedule import Whole
from jax_transformer.settings.config import DecodeConfig
from parity_tests.test_decoding_parity import SCORE_ATOL, one_torch_thread  # noqa: F401 (an autouse fixture)
from tests.helpers.saved import load_saved_model
from tests.helpers.twins import t, torch_twin
from torch_reference import decoding as torch_decoding

BEAMS, N_BEST, ROWS = 4, 3, 6


@pytest.mark.slow
@pytest.mark.parametrize("order", ["unordered", "ordered"])
def test_constrained_beam_search_matches_the_twin(order):
    saved = load_saved_model("trained_tiny")
    config, params = saved.config, saved.params
    src = saved.sources[:ROWS]
    decode = DecodeConfig(beam_size=BEAMS, n_best=N_BEST, constraint_order=order)
    plain = decoders.decoder(config, decode, src.shape[1])(params, src, Whole()).tokens[:, 0]
    words = [[int(i) for i in row if i not in (config.eos_id, config.pad_id)] for row in plain]
    phrases, banned = [], []
    for row in range(ROWS):
        other, another = words[(row + 3) % ROWS], words[(row + 5) % ROWS]
        wanted = [other[-2:], another[:1]] if row % 3 == 0 else [other[:1]] if row % 3 == 1 else None
        phrases.append(wanted)
        own = words[row][-1:]  # its own last word, banned where no phrase holds it
        banned.append([own] if row % 4 == 1 and not any(own[0] in p for p in wanted or []) else None)
    ours = decoders.decoder(config, decode, src.shape[1])(params, src, Whole(), None, phrases, banned)
    model = torch_twin(config, params)
    theirs = torch_decoding.beam_search(
        model, t(src), beam_size=BEAMS, alpha=decode.alpha, n_best=N_BEST, use_cache=True, min_len=0,
        constraints=phrases, ordered=order == "ordered", banned=banned,
    )  # fmt: skip
    np.testing.assert_array_equal(ours.found, theirs.found.cpu().numpy())
    np.testing.assert_array_equal(np.where(ours.found[..., None], ours.tokens, 0),
                                  np.where(ours.found[..., None], theirs.tokens.cpu().numpy(), 0))  # fmt: skip
    scores = np.where(ours.found, ours.scores - theirs.scores.cpu().numpy(), 0.0)
    assert float(np.max(np.abs(scores))) <= SCORE_ATOL
    assert any(p is not None for p in phrases) and ours.found[:, 0].all()
