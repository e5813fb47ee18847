"""The model's parameters as flat {path: array} maps, and every parameter's shape for a config, traced abstractly."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jax_transformer.settings.config import TransformerConfig


def flatten(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """{("encoder", "layer_0", ..., "kernel"): array} of a nested parameter tree."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, prefix + (key,)))
        else:
            flat[prefix + (key,)] = value
    return flat


def unflatten(flat: Mapping[tuple[str, ...], Any]) -> dict[str, Any]:
    """The nested tree of a `flatten`ed one."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def expected_param_shapes(config: TransformerConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Every Flax parameter path of `config`'s model with its shape (traced abstractly: nothing is allocated)."""
    import jax

    from jax_transformer.model.transformer import init_params

    shapes = jax.eval_shape(lambda: init_params(config))
    return {path: tuple(s.shape) for path, s in flatten(shapes).items()}
