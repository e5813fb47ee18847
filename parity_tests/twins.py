"""Builds the same model in both frameworks: fresh Flax parameters, ported into the PyTorch twin."""
import numpy as np
import torch

import torch_reference
from jax_transformer.model import Transformer, init_params
from jax_transformer.port import flax_to_torch


def twin_models(config, seed: int = 0):
    """(flax module, flax params, torch module in eval mode holding the same weights)."""
    params = init_params(config, seed)
    torch_model = torch_reference.Transformer(config).eval()
    torch_reference.load_numpy_state_dict(torch_model, flax_to_torch(params))
    return Transformer(config), params, torch_model


def t(array) -> torch.Tensor:
    return torch.from_numpy(np.asarray(array))


def max_abs_diff(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = b.detach().numpy().astype(np.float64) if isinstance(b, torch.Tensor) else np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"shape mismatch {a.shape} vs {b.shape}"
    return float(np.max(np.abs(a - b))) if a.size else 0.0
