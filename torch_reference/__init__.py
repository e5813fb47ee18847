"""The PyTorch twin of `jax_transformer`: same config, same architecture, same parameter names."""

from torch_reference.interop import config_from_nn_transformer, load_numpy_state_dict, numpy_state_dict
from torch_reference.model import Transformer, causal_mask, decoder_self_mask, padding_mask

__all__ = [
    "Transformer",
    "padding_mask",
    "causal_mask",
    "decoder_self_mask",
    "load_numpy_state_dict",
    "numpy_state_dict",
    "config_from_nn_transformer",
]
