"""The fixed sinusoidal position tables (paper section 3.5), in numpy so both frameworks share them bit for bit:
the paper's, PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...), with sines and cosines interleaved
(as the Annotated Transformer), and the variants of the models this project imports: the same values in halves,
all sines then all cosines (Marian), and tensor2tensor's frequencies in halves from position pad + 1 (fairseq)."""

import math

import numpy as np


def sinusoidal_table(
    max_len: int, d_model: int, layout: str = "interleaved", frequencies: str = "paper", offset: int = 0
) -> np.ndarray:
    """(max_len, d_model) float32: the rows of positions offset .. offset + max_len - 1.

    "paper" frequencies are computed in float64 and rounded once, as Marian does (so its halves table and the
    interleaved one are column permutations of each other, bit for bit); "tensor2tensor" frequencies and angles in
    float32, as fairseq computes its table. An odd d_model leaves its last column 0 in the halves layout, as both do."""
    position = np.arange(offset, offset + max_len)
    half = d_model // 2
    if frequencies == "paper":
        exponent = 2 * np.arange((d_model + 1) // 2) / d_model  # (ceil(d/2),): 2i / d
        angles = position[:, None].astype(np.float64) / np.power(10000.0, exponent)[None, :]
        sines, cosines = np.sin(angles), np.cos(angles[:, :half])
    elif frequencies == "tensor2tensor":
        step = np.float32(-math.log(10000) / (half - 1))
        # exp of the float32 exponents, correctly rounded to float32 (torch's float32 exp gives these; numpy's is
        # an ulp off on some), then float32 angles: fairseq's table to within an ulp of its sin and cos
        inv_freq = np.exp((np.arange(half, dtype=np.float32) * step).astype(np.float64)).astype(np.float32)
        angles = position[:, None].astype(np.float32) * inv_freq[None, :]
        sines, cosines = np.sin(angles), np.cos(angles)
    else:
        raise ValueError(f"frequencies must be 'paper' or 'tensor2tensor', got {frequencies!r}")
    table = np.zeros((max_len, d_model), dtype=np.float64)
    if layout == "interleaved":
        table[:, 0::2], table[:, 1::2] = sines, cosines
    elif layout == "halves":
        table[:, : sines.shape[1]], table[:, sines.shape[1] : sines.shape[1] + half] = sines, cosines
    else:
        raise ValueError(f"layout must be 'interleaved' or 'halves', got {layout!r}")
    return table.astype(np.float32)


def position_table(config) -> np.ndarray:
    """The sinusoid table a `TransformerConfig` asks for: (max_len, d_model) float32."""
    return sinusoidal_table(
        config.max_len, config.d_model, config.sinusoid_layout, config.sinusoid_frequencies, config.position_offset
    )
