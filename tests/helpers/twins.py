"""The model in both frameworks: ported weights, the PyTorch twin on its device, and comparing what they compute."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jax_transformer.settings.config import TransformerConfig


def ported_params(config: TransformerConfig, seed: int = 0) -> tuple[Any, dict[str, np.ndarray]]:
    """Fresh Flax parameters (init_params(config, seed)) and the same weights as a PyTorch state dict of numpy
    arrays (jax_transformer.interop.port.flax_to_torch), for torch_reference.load_numpy_state_dict."""
    from jax_transformer.interop.port import flax_to_torch
    from jax_transformer.model.transformer import init_params

    params = init_params(config, seed)
    return params, flax_to_torch(params)


def twin_device() -> str:
    """Where the PyTorch twin runs in tests, parity tests and benchmarks: $TWIN_DEVICE ("cpu" or "cuda"; default
    "cpu"). JAX computes on its own default device (the GPU where there is one) whatever this says."""
    return os.environ.get("TWIN_DEVICE", "cpu")


def torch_twin(config: TransformerConfig, params, device: str | None = None):
    """A torch_reference.Transformer in eval mode holding the Flax `params` (ported by flax_to_torch), on `device`
    (default twin_device())."""
    import torch_reference
    from jax_transformer.interop.port import flax_to_torch

    model = torch_reference.Transformer(config).to(device or twin_device())
    return torch_reference.load_numpy_state_dict(model, flax_to_torch(params)).eval()


def twin_models(config: TransformerConfig, seed: int = 0):
    """The same model in both frameworks: (Flax module, fresh Flax params, torch module in eval mode holding the
    same weights)."""
    from jax_transformer.model.transformer import Transformer, init_params

    params = init_params(config, seed)
    return Transformer(config), params, torch_twin(config, params)


def eos_biased(config: TransformerConfig, params, first_log_probs: np.ndarray):
    """Params whose untied output bias on EOS puts EOS first at step 0 for about half of the rows.

    Random models rarely emit EOS. `first_log_probs` (B, V) are each source row's log-probs of the first output
    token, from either framework. The bias is raised halfway between two neighbouring rows' step-0 margins (best
    other log-prob minus EOS log-prob), so no row is near a tie at step 0.
    """
    eos = config.eos_id
    margin = np.sort(np.delete(first_log_probs, eos, axis=1).max(axis=1) - first_log_probs[:, eos])
    k = len(margin) // 2
    bias = params["output_proj"]["bias"].at[eos].add((margin[k - 1] + margin[k]) / 2)
    return {**params, "output_proj": {**params["output_proj"], "bias": bias}}


def t(array):
    """A numpy (or jax) array as a torch tensor on twin_device(). Integer arrays (the int32 ids above) become int64,
    torch's index type; floats and booleans keep their dtype."""
    import torch

    array = np.asarray(array)
    tensor = torch.from_numpy(array)
    tensor = tensor.long() if np.issubdtype(array.dtype, np.integer) else tensor
    return tensor.to(twin_device())


def to_numpy(tensor) -> np.ndarray:
    """A torch tensor (any device, any float dtype: bfloat16 as float32) as a numpy array."""
    import torch

    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def max_abs_diff(a, b) -> float:
    """Largest absolute elementwise difference (in float64) of two arrays or tensors of the same shape."""
    import torch

    a = to_numpy(a).astype(np.float64) if isinstance(a, torch.Tensor) else np.asarray(a, dtype=np.float64)
    b = to_numpy(b).astype(np.float64) if isinstance(b, torch.Tensor) else np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"shape mismatch {a.shape} vs {b.shape}"
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def flat(tree) -> dict[str, np.ndarray]:
    """A pytree as {path: numpy array}, for leaf-by-leaf comparisons; typed PRNG keys as their raw words."""
    import jax

    def as_array(leaf):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        return np.asarray(leaf)

    return {jax.tree_util.keystr(path): as_array(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
