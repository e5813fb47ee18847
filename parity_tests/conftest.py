"""Shared set-up for the cross-framework parity tests.

Both frameworks compute in float32. JAX is told to use full-precision matmuls ("highest": on CPU this is already
the case, on TPU/GPU it turns off bf16/TF32 passes) and PyTorch to use deterministic kernels without TF32, so the
only remaining differences are float32 rounding in different summation orders.

Every check records the largest difference it saw with `parity_report`; the table is printed at the end of the
run (also without -s), so parity is shown as numbers and not only as a pass.
"""
from __future__ import annotations

import os

import jax
import numpy as np
import pytest
import torch

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_enable_x64", False)
torch.use_deterministic_algorithms(True)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

from jax_transformer.config import TransformerConfig, preset  # noqa: E402

_REPORT: list[tuple[str, str, float, float]] = []


@pytest.fixture
def parity_report():
    """report(check, case, observed_max_difference, tolerance): records a figure for the summary table."""

    def report(check: str, case: str, observed: float, tolerance: float) -> None:
        _REPORT.append((check, case, float(observed), float(tolerance)))
        print(f"[parity] {check:<42} {case:<28} max diff {observed:.3e}  (tol {tolerance:.0e})")

    return report


def pytest_terminal_summary(terminalreporter):
    if not _REPORT:
        return
    terminalreporter.section("parity: maximum differences measured")
    terminalreporter.write_line(f"{'check':<42} {'case':<28} {'max diff':>10} {'tolerance':>10}")
    for check, case, observed, tolerance in _REPORT:
        terminalreporter.write_line(f"{check:<42} {case:<28} {observed:>10.3e} {tolerance:>10.0e}")


# --- configurations every check runs over ---------------------------------------------------------------

_SMALL = dict(d_model=64, num_heads=4, d_ff=128, num_encoder_layers=2, num_decoder_layers=2, max_len=32,
              src_vocab_size=97, tgt_vocab_size=89)

CONFIGS: dict[str, TransformerConfig] = {
    # the paper: post-norm, sinusoidal, tied output, relu, biased projections
    "post_sinusoidal_tied_relu": TransformerConfig(**_SMALL),
    # the Annotated Transformer's layout: pre-norm with final norms; plus learned positions, untied, gelu, and no
    # bias anywhere (attention, feed-forward, LayerNorms, the output head), as nn.Transformer(bias=False)
    "pre_learned_untied_gelu_nobias": TransformerConfig(**_SMALL, norm_first=True, final_norm=True,
                                                        positions="learned", tie_output=False,
                                                        activation="gelu", qkv_bias=False, ffn_bias=False,
                                                        norm_bias=False, output_bias=False),
    # one shared source/target table, unscaled embeddings, post-norm with final norms
    "post_shared_unscaled_final": TransformerConfig(**{**_SMALL, "tgt_vocab_size": 97}, share_embeddings=True,
                                                    scale_embeddings=False, final_norm=True),
}

# The paper's base model (512, 8 heads, 2048, 6+6, post-norm, sinusoidal, ReLU) with a small vocabulary: the
# vocabulary size does not change the per-element arithmetic, only the cost.
BASE = preset("base", src_vocab_size=1000, tgt_vocab_size=1000, max_len=32)


def make_batch(config: TransformerConfig, seed: int = 0, batch: int = 4, src_len: int = 11, tgt_len: int = 9):
    """Source/target ids with real padding: every row a different length, the last row all padding.
    Returns numpy int arrays src (B, S), tgt_in (B, T), tgt_out (B, T)."""
    rng = np.random.default_rng(seed)
    pad, bos, eos = config.pad_id, config.bos_id, config.eos_id
    src = np.full((batch, src_len), pad, dtype=np.int64)
    tgt = np.full((batch, tgt_len + 1), pad, dtype=np.int64)
    for row in range(batch - 1):  # the last row stays all padding
        n_src = src_len - 1 - 3 * row if row else src_len - 1  # first row fills the source exactly
        n_tgt = max(1, tgt_len - 1 - 2 * row)
        src[row, :n_src] = rng.integers(4, config.src_vocab_size, n_src)
        src[row, n_src] = eos
        tgt[row, 0] = bos
        tgt[row, 1:n_tgt + 1] = rng.integers(4, config.tgt_vocab_size, n_tgt)
        tgt[row, n_tgt + 1] = eos
    tgt_in, tgt_out = tgt[:, :-1].copy(), tgt[:, 1:].copy()
    tgt_in[tgt_in == eos] = pad  # EOS is an output, never an input
    return src, tgt_in, tgt_out


@pytest.fixture(params=list(CONFIGS), ids=list(CONFIGS))
def config_case(request):
    return request.param, CONFIGS[request.param]
