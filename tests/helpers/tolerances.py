"""bfloat16 tolerances, derived in parity_tests/test_bf16_parity.py's docstring; used there and in
parity_tests/test_attention_kernels.py."""

from __future__ import annotations

import math

import numpy as np

from jax_transformer.settings.config import TransformerConfig

BF16_ULP_AT_1 = 2.0**-7  # bfloat16: 8 significant bits, so one ulp of a value in [1, 2) is 2^-7


def bf16_ulp(magnitude: float) -> float:
    """One bfloat16 ulp at `magnitude`: 2^(e - 7) for a value in [2^e, 2^(e+1))."""
    return BF16_ULP_AT_1 * 2.0 ** math.floor(math.log2(magnitude))


def layers(config: TransformerConfig) -> int:
    """Encoder plus decoder layers: the stages a bfloat16 difference grows through (one ulp each at most)."""
    return config.num_encoder_layers + config.num_decoder_layers


def logit_tolerance(config, logits) -> float:
    """n_layers bfloat16 ulps at the largest logit's magnitude (derivation: parity_tests/test_bf16_parity.py)."""
    return layers(config) * bf16_ulp(float(np.max(np.abs(np.asarray(logits)))))


def gradient_tolerance(config) -> float:
    """Bound on ||g_flax - g_torch|| / ||g_torch|| per gradient tensor: 2 n_layers ulps of relative size 2^-7."""
    return 2 * layers(config) * BF16_ULP_AT_1
