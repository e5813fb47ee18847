"""Ensemble parity: an ensemble of two models of different seeds (jax_transformer.decoding.ensemble: stacked,
vmapped, one program) and of two models of different sizes (two groups stepped together) against the PyTorch twin's
ensemble (torch_reference.decoding.Ensemble: each member's decoder re-run over the whole prefix, or with its own
cache, their probabilities averaged with the same weights), greedy and beam search.

Tokens must be identical; scores agree as test_decoding_parity.py's do (5e-5: up to 16 log-probs summed, each
~1e-6 apart, the combination's logsumexp adding float32 rounding of the same size). Both members have EOS raised
(`eos_biased`), so outputs end at various lengths.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jax_transformer.decoding import decoders, ensemble
from jax_transformer.decoding.schedule import Whole
from jax_transformer.model.transformer import init_params
from jax_transformer.settings.config import DecodeConfig
from parity_tests.test_decoding_parity import (  # noqa: F401 (one_torch_thread: an autouse fixture)
    LENGTHS,
    SCORE_ATOL,
    one_torch_thread,
    with_eos_bias,
)
from tests.helpers.batches import make_src
from tests.helpers.configs import DECODING_CONFIGS as CONFIGS
from tests.helpers.twins import t, torch_twin
from torch_reference import decoding as torch_decoding

# One layer each side (the loops compile in seconds); the second size is wider.
CONFIG = dataclasses.replace(CONFIGS["post_sinusoidal_untied"], num_encoder_layers=1, num_decoder_layers=1)
WIDER = dataclasses.replace(CONFIG, d_model=48, d_ff=96)
WEIGHTS = (0.6, 0.4)


@pytest.mark.slow  # four loops to compile, each pair of twins decoding twice
@pytest.mark.parametrize("second", ["same size", "wider"])
def test_the_twins_ensembles_decode_alike(second, parity_report):
    src = make_src(CONFIG, LENGTHS, seed=3)
    other = CONFIG if second == "same size" else WIDER
    params = [with_eos_bias(CONFIG, init_params(CONFIG, 0), src), with_eos_bias(other, init_params(other, 1), src)]
    found = ensemble.Ensemble.of([CONFIG, other], params, WEIGHTS)
    twin = torch_decoding.Ensemble([torch_twin(c, p) for c, p in zip((CONFIG, other), params)], WEIGHTS)
    searches = {
        "greedy": (dict(beam_size=1), lambda **o: torch_decoding.greedy_search(twin, t(src), **o)),
        "beam 4": (
            dict(beam_size=4, alpha=0.6),
            lambda **o: torch_decoding.beam_search(twin, t(src), beam_size=4, **o),
        ),
    }
    ends = set()
    for what, (options, torch_search) in searches.items():
        out = decoders.decoder(found.config, DecodeConfig(**options), src.shape[1])
        tokens, scores = out(found.params, src, Whole()).best()
        for use_cache in (False, True):
            torch_tokens, torch_scores = (x.cpu().numpy() for x in torch_search(use_cache=use_cache))
            np.testing.assert_array_equal(tokens, torch_tokens, err_msg=f"{what}, cache {use_cache}")
            diff = float(np.max(np.abs(scores - torch_scores)))
            parity_report(f"ensemble {what} vs torch {'cached' if use_cache else 'uncached'}", second, diff, SCORE_ATOL)
            assert diff <= SCORE_ATOL
        ends |= {int(np.count_nonzero(row != CONFIG.pad_id)) for row in tokens}
    assert 1 in ends and max(ends) > 1  # some outputs end with EOS at once, others run on
