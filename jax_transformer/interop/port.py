"""Weights between the Flax model and PyTorch, on numpy arrays only (importing this never imports torch): the twins
use the same names, so the map is a few rules (layer numbering, the transposed Dense kernel, LayerNorm's scale);
`from_nn_transformer` imports PyTorch's own `torch.nn.Transformer`. The table: docs/internals.md#port."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from jax_transformer.errors import PortError
from jax_transformer.model.params import expected_param_shapes, flatten, unflatten
from jax_transformer.settings.config import TransformerConfig

# --- names ----------------------------------------------------------------------------------------------

_LEAF_TO_TORCH = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}


def torch_name(flax_path: tuple[str, ...]) -> str:
    """("encoder", "layer_0", "self_attention", "query", "kernel") -> "encoder.layers.0.self_attention.query.weight"."""
    *modules, leaf = flax_path
    modules = [re.sub(r"^layer_(\d+)$", r"layers.\1", m) for m in modules]
    return ".".join(modules + [_LEAF_TO_TORCH.get(leaf, leaf)])  # logits_bias keeps its name


def _is_transposed(flax_path: tuple[str, ...]) -> bool:
    return flax_path[-1] == "kernel"


# --- arrays and dtypes -----------------------------------------------------------------------------------


def _to_numpy(name: str, value: Any, convert_dtypes: bool) -> np.ndarray:
    """A torch tensor or array-like -> float32 numpy. Other float dtypes are converted only when asked."""
    if hasattr(value, "detach"):  # a torch.Tensor, handled without importing torch
        value = value.detach().cpu()
        if str(value.dtype) != "torch.float32":
            if not convert_dtypes or not value.is_floating_point():
                raise PortError(
                    f"{name}: dtype {value.dtype}, expected torch.float32 "
                    f"(pass convert_dtypes=True to convert floating-point weights)"
                )
            value = value.float()
        value = value.numpy()
    array = np.asarray(value)
    if array.dtype != np.float32:
        if not convert_dtypes or not np.issubdtype(array.dtype, np.floating):
            raise PortError(
                f"{name}: dtype {array.dtype}, expected float32 "
                f"(pass convert_dtypes=True to convert floating-point weights)"
            )
        array = array.astype(np.float32)
    return array


# --- Flax <-> torch_reference ------------------------------------------------------------------------------


def flax_to_torch(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Flax params (nested dict of arrays) -> a torch_reference state_dict of numpy float32 arrays.
    Wrap with `torch.from_numpy` (or `torch_reference.load_numpy_state_dict`) to load it."""
    state = {}
    for path, value in flatten(params).items():
        array = np.asarray(value)
        state[torch_name(path)] = np.ascontiguousarray(array.T if _is_transposed(path) else array)
    return state


def torch_to_flax(
    state_dict: Mapping[str, Any], config: TransformerConfig, *, convert_dtypes: bool = False
) -> dict[str, Any]:
    """A torch_reference state_dict (torch tensors or numpy arrays) -> Flax params for `config`, strictly:
    missing keys, unexpected keys and shape mismatches are reported together in one PortError."""
    expected = expected_param_shapes(config)
    by_torch_name = {torch_name(path): path for path in expected}
    problems = []
    for name in sorted(set(by_torch_name) - set(state_dict)):
        problems.append(f"missing {name}: expected shape {_torch_shape(by_torch_name[name], expected)}")
    for name in sorted(set(state_dict) - set(by_torch_name)):
        problems.append(f"unexpected {name}: shape {tuple(np.shape(state_dict[name]))}")
    flat = {}
    for name, path in by_torch_name.items():
        if name not in state_dict:
            continue
        array = _to_numpy(name, state_dict[name], convert_dtypes)
        want = _torch_shape(path, expected)
        if array.shape != want:
            problems.append(f"shape mismatch {name}: expected {want}, got {array.shape}")
            continue
        flat[path] = np.ascontiguousarray(array.T if _is_transposed(path) else array)
    if problems:
        raise PortError(
            f"{len(problems)} problem(s) porting a PyTorch state_dict to the Flax model:\n  " + "\n  ".join(problems)
        )
    return unflatten(flat)


def _torch_shape(path, expected) -> tuple[int, ...]:
    shape = expected[path]
    return tuple(reversed(shape)) if _is_transposed(path) else shape


# --- torch.nn.Transformer -> Flax ------------------------------------------------------------------------

# nn.Transformer's names inside a layer -> this project's names.
_NN_ENCODER_LAYER = {
    "self_attn": "self_attention",
    "linear1": "feed_forward.linear1",
    "linear2": "feed_forward.linear2",
    "norm1": "self_attention_norm",
    "norm2": "feed_forward_norm",
}
_NN_DECODER_LAYER = {
    "self_attn": "self_attention",
    "multihead_attn": "cross_attention",
    "linear1": "feed_forward.linear1",
    "linear2": "feed_forward.linear2",
    "norm1": "self_attention_norm",
    "norm2": "cross_attention_norm",
    "norm3": "feed_forward_norm",
}


def nn_transformer_to_twin(
    transformer_state: Mapping[str, Any], *, convert_dtypes: bool = False
) -> dict[str, np.ndarray]:
    """Renames a `torch.nn.Transformer` state_dict to torch_reference names (numpy), splitting each fused
    `in_proj_weight` (3D, D) / `in_proj_bias` (3D,) into query, key and value. Unknown keys are an error.
    Only the keys present are renamed: a model built with `bias=False` has no bias keys, and gives none."""
    out: dict[str, np.ndarray] = {}
    unknown = []
    for key, value in transformer_state.items():
        array = _to_numpy(key, value, convert_dtypes)
        m = re.fullmatch(r"(encoder|decoder)\.layers\.(\d+)\.(\w+)\.(\w+)(?:\.(\w+))?", key)
        if m:
            stack, index, module, p1, p2 = m.groups()
            table = _NN_ENCODER_LAYER if stack == "encoder" else _NN_DECODER_LAYER
            if module not in table:
                unknown.append(key)
                continue
            prefix = f"{stack}.layers.{index}.{table[module]}"
            if p1 in ("in_proj_weight", "in_proj_bias"):  # fused [W_q; W_k; W_v] stacked on the output axis
                kind = "weight" if p1 == "in_proj_weight" else "bias"
                for part, chunk in zip(("query", "key", "value"), np.split(array, 3, axis=0)):
                    out[f"{prefix}.{part}.{kind}"] = np.ascontiguousarray(chunk)
            elif p1 == "out_proj":
                out[f"{prefix}.out.{p2}"] = array
            elif p2 is None:  # linear1.weight, norm1.bias, ...
                out[f"{prefix}.{p1}"] = array
            else:
                unknown.append(key)
            continue
        m = re.fullmatch(r"(encoder|decoder)\.norm\.(weight|bias)", key)
        if m:
            out[f"{m.group(1)}.final_norm.{m.group(2)}"] = array
            continue
        unknown.append(key)
    if unknown:
        raise PortError(f"unexpected torch.nn.Transformer keys: {sorted(unknown)}")
    return out


def from_nn_transformer(
    transformer_state: Mapping[str, Any],
    config: TransformerConfig,
    *,
    source_embedding: Any,
    target_embedding: Any = None,
    output_weight: Any = None,
    output_bias: Any = None,
    source_positions: Any = None,
    target_positions: Any = None,
    convert_dtypes: bool = False,
) -> dict[str, Any]:
    """Flax params from a `torch.nn.Transformer` state_dict plus the embeddings and output projection that
    surround it in a user's model (nn.Transformer has none of its own).

    `config` must describe that model: `final_norm=True` (nn.Transformer always has final norms), `norm_first`
    as the layers were built, `activation`, `layer_norm_eps`, and the biases `qkv_bias`, `ffn_bias`, `norm_bias`
    (all False for `nn.Transformer(..., bias=False)`: its state_dict then has no bias keys at all);
    `torch_reference.interop.config_from_nn_transformer` reads these off a module. With `share_embeddings`
    pass only `source_embedding`; with `tie_output` leave `output_weight` out; an output layer without bias
    needs `output_bias=False` in the config and no `output_bias` here; learned positions need
    `source_positions`/`target_positions` of shape (max_len, d_model).
    """
    state = nn_transformer_to_twin(transformer_state, convert_dtypes=convert_dtypes)
    extras = {
        "source_embed.weight": source_embedding,
        "target_embed.weight": target_embedding,
        "output_proj.weight": output_weight,
        "output_proj.bias": output_bias,
        "encoder.positions.weight": source_positions,
        "decoder.positions.weight": target_positions,
    }
    if config.share_embeddings:
        if target_embedding is not None:
            raise PortError("config.share_embeddings is true: pass only source_embedding")
        extras["shared_embed.weight"] = extras.pop("source_embed.weight")
        extras.pop("target_embed.weight")
    state.update({k: v for k, v in extras.items() if v is not None})
    return torch_to_flax(state, config, convert_dtypes=convert_dtypes)
