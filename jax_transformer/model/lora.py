"""LoRA adapters beside the model's matrices: `lora_a` (D_in, r) and `lora_b` (r, D_out) next to a `Dense` kernel
(`transformer.Dense` computes x W + dropout(x) A B alpha / r, as peft's `lora.Linear` does), fresh adapters for a
model (`with_adapters`), and the adapters folded into the kernels (`merged`, peft's merge_and_unload), so that an
adapted run decodes, quantizes and goes to the twin as the plain model it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_transformer.model.params import expected_param_shapes, flatten, unflatten
from jax_transformer.settings.config import TransformerConfig

ADAPTER_LEAVES = ("lora_a", "lora_b")


def adapter_paths(config: TransformerConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Every adapter parameter of `config`'s model with its shape."""
    return {p: s for p, s in expected_param_shapes(config).items() if p[-1] in ADAPTER_LEAVES}


def with_adapters(params: Mapping[str, Any], config: TransformerConfig, seed: int = 0) -> dict:
    """`params` of a model without adapters (or with some) completed with fresh ones for `config`: A drawn as
    the model initialises it (peft's kaiming-uniform), B zeros, so the model computes what it did before."""
    flat = flatten(params)
    key = jax.random.key(seed)
    bound_of = lambda shape: 1 / np.sqrt(shape[0])  # noqa: E731  U(-1/sqrt(D_in), 1/sqrt(D_in))
    for i, (path, shape) in enumerate(sorted(adapter_paths(config).items())):
        if path in flat:
            continue
        if path[-1] == "lora_a":
            bound = bound_of(shape)
            flat[path] = jax.random.uniform(jax.random.fold_in(key, i), shape, jnp.float32, -bound, bound)
        else:
            flat[path] = jnp.zeros(shape, jnp.float32)
    return unflatten(flat)


def merged(params: Mapping[str, Any], config: TransformerConfig) -> tuple[dict, TransformerConfig]:
    """(params, config) of the same function without adapters: each adapted kernel W + A B alpha / r (computed in
    float32 on the host), as peft's merge_and_unload writes it. A QLoRA base is dequantized first (the int8
    values times their scales: the weights its training computed with)."""
    if not config.lora_rank:
        return dict(params), config
    from jax_transformer.model import quantization

    params = _float(quantization.dequantize_params(params))
    flat = {p: np.asarray(v, np.float32) for p, v in flatten(params).items()}
    scale = config.lora_alpha / config.lora_rank
    for path in [p for p in flat if p[-1] == "lora_a"]:
        module = path[:-1]
        a, b = flat.pop(path), flat.pop((*module, "lora_b"))
        flat[(*module, "kernel")] = flat[(*module, "kernel")] + (a @ b) * scale
    return unflatten(flat), config.replace(lora_rank=0)


def _float(tree):
    """A parameter tree read from a QLoRA checkpoint without its template, whose int8 arrays are {qvalue, scale}
    dicts, with each of them as the float32 array it stands for (symmetric: the values times their scales)."""
    if not isinstance(tree, Mapping):
        return tree
    if {"qvalue", "scale"} <= set(tree):
        return np.asarray(tree["qvalue"], np.float32) * np.asarray(tree["scale"], np.float32)
    return {key: _float(value) for key, value in tree.items()}
