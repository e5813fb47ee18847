"""The fixed sinusoidal position table of the paper (section 3.5), in numpy so both frameworks share it bit for bit.

    PE(pos, 2i)   = sin(pos / 10000^(2i / d_model))
    PE(pos, 2i+1) = cos(pos / 10000^(2i / d_model))

Even feature columns hold sines and odd columns cosines (the paper's interleaved layout, as in the Annotated
Transformer), not the [sin..., cos...] halves some implementations use.
"""

import numpy as np


def sinusoidal_table(max_len: int, d_model: int) -> np.ndarray:
    """(max_len, d_model) float32 table, computed in float64 and rounded once."""
    position = np.arange(max_len, dtype=np.float64)[:, None]  # (T, 1)
    inv_freq = np.exp(np.arange(0, d_model, 2, dtype=np.float64) * (-np.log(10000.0) / d_model))  # (ceil(d/2),)
    angles = position * inv_freq  # (T, ceil(d/2))
    table = np.zeros((max_len, d_model), dtype=np.float64)
    table[:, 0::2] = np.sin(angles)
    table[:, 1::2] = np.cos(angles[:, : d_model // 2])
    return table.astype(np.float32)
