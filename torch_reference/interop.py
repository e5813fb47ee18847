"""Glue between torch modules and the numpy weight map of `jax_transformer.interop.port`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from jax_transformer.settings.config import TransformerConfig


def load_numpy_state_dict(model: nn.Module, state: Mapping[str, np.ndarray]) -> nn.Module:
    """Loads a state_dict of numpy arrays (from `jax_transformer.interop.port.flax_to_torch`) strictly."""
    model.load_state_dict({k: torch.from_numpy(np.array(v, copy=True)) for k, v in state.items()}, strict=True)
    return model


def numpy_state_dict(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's state_dict as numpy float32 arrays (copies), ready for
    `jax_transformer.interop.port.torch_to_flax`."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def _activation_name(layer: nn.Module) -> str:
    """ "relu" or "gelu" (exact) for an nn.Transformer layer's activation (a function or a module); else ValueError."""
    activation = layer.activation
    name = getattr(activation, "__name__", type(activation).__name__).lower()
    if name not in ("relu", "gelu"):
        raise ValueError(f"nn.Transformer activation {activation!r} is not relu or gelu")
    if isinstance(activation, nn.GELU) and activation.approximate != "none":
        raise ValueError("nn.Transformer uses tanh-approximated GELU; only exact GELU is supported")
    return name


def config_from_nn_transformer(transformer: nn.Transformer, **fields: Any) -> TransformerConfig:
    """A TransformerConfig describing a `torch.nn.Transformer`'s layers; `fields` gives the rest (vocabulary
    sizes, positions, embedding options...). Reads d_model, heads, d_ff, layer counts, norm placement, final
    norms, LayerNorm epsilon, activation (relu or exact gelu) and which biases exist (attention in_proj/out_proj:
    `qkv_bias`; linear1/linear2: `ffn_bias`; LayerNorms: `norm_bias`; all absent with `bias=False`) off the module.
    The config has one switch per setting, so a module whose layers disagree (custom layers) is a ValueError."""
    layers = list(transformer.encoder.layers) + list(transformer.decoder.layers)
    if not layers:
        raise ValueError("nn.Transformer has no encoder or decoder layers to read the config from")
    attentions = [
        a for layer in layers for a in (layer.self_attn, getattr(layer, "multihead_attn", None)) if a is not None
    ]
    final_norms = [transformer.encoder.norm, transformer.decoder.norm]
    norms = [n for layer in layers for n in (layer.norm1, layer.norm2, getattr(layer, "norm3", None)) if n is not None]
    norms += [n for n in final_norms if n is not None]
    if any(
        a.bias_k is not None or a.add_zero_attn or a.kdim != a.embed_dim or a.vdim != a.embed_dim for a in attentions
    ):
        raise ValueError(
            "nn.Transformer attention uses add_bias_kv, add_zero_attn or kdim/vdim, which the model does not have"
        )
    if any(not n.elementwise_affine for n in norms):
        raise ValueError("nn.Transformer has a LayerNorm without elementwise_affine, which the model does not have")
    # Every value of each setting over all layers (and both final norms); each must be one value.
    seen = {
        "d_model": {a.embed_dim for a in attentions},
        "num_heads": {a.num_heads for a in attentions},
        "d_ff": {layer.linear1.out_features for layer in layers},
        "norm_first": {layer.norm_first for layer in layers},
        "final_norm": {n is not None for n in final_norms},
        "layer_norm_eps": {n.eps for n in norms},
        "activation": {_activation_name(layer) for layer in layers},
        "qkv_bias": {p is not None for a in attentions for p in (a.in_proj_bias, a.out_proj.bias)},
        "ffn_bias": {m.bias is not None for layer in layers for m in (layer.linear1, layer.linear2)},
        "norm_bias": {n.bias is not None for n in norms},
    }
    mixed = {name: sorted(values, key=str) for name, values in seen.items() if len(values) > 1}
    if mixed:
        raise ValueError(f"nn.Transformer layers disagree on {mixed}; the config has one value for each")
    derived = {name: next(iter(values)) for name, values in seen.items()}
    derived.update(
        num_encoder_layers=len(transformer.encoder.layers), num_decoder_layers=len(transformer.decoder.layers)
    )
    return TransformerConfig.from_dict({**derived, **fields}, source="config_from_nn_transformer")
