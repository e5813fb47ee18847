"""Glue between torch modules and the numpy weight map of `jax_transformer.port`."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from jax_transformer.config import TransformerConfig


def load_numpy_state_dict(model: nn.Module, state: Mapping[str, np.ndarray]) -> nn.Module:
    """Loads a state_dict of numpy arrays (from `jax_transformer.port.flax_to_torch`) strictly."""
    model.load_state_dict({k: torch.from_numpy(np.array(v, copy=True)) for k, v in state.items()}, strict=True)
    return model


def numpy_state_dict(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's state_dict as numpy float32 arrays (copies), ready for `jax_transformer.port.torch_to_flax`."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def config_from_nn_transformer(transformer: nn.Transformer, **fields: Any) -> TransformerConfig:
    """A TransformerConfig describing a `torch.nn.Transformer`'s layers; `fields` gives the rest (vocabulary
    sizes, positions, embedding options...). Reads d_model, heads, d_ff, layer counts, norm placement,
    LayerNorm epsilon, activation (relu or exact gelu) and projection bias off the module."""
    enc_layer = transformer.encoder.layers[0]
    activation = enc_layer.activation
    name = getattr(activation, "__name__", type(activation).__name__).lower()
    if name not in ("relu", "gelu"):
        raise ValueError(f"nn.Transformer activation {activation!r} is not relu or gelu")
    if isinstance(activation, nn.GELU) and activation.approximate != "none":
        raise ValueError("nn.Transformer uses tanh-approximated GELU; only exact GELU is supported")
    attn = enc_layer.self_attn
    derived = dict(
        d_model=attn.embed_dim, num_heads=attn.num_heads, d_ff=enc_layer.linear1.out_features,
        num_encoder_layers=len(transformer.encoder.layers), num_decoder_layers=len(transformer.decoder.layers),
        norm_first=enc_layer.norm_first, final_norm=True, layer_norm_eps=enc_layer.norm1.eps,
        activation=name, qkv_bias=attn.in_proj_bias is not None,
    )
    return TransformerConfig.from_dict({**derived, **fields}, source="config_from_nn_transformer")
