"""The original encoder-decoder Transformer in Flax linen (docs/design.md: the tour).

Importing this package imports neither jax nor torch: `jax_transformer.config` and `jax_transformer.data` are
plain Python/numpy, and the PyTorch twin reads the same config. Flax pieces load on first use.
"""

from jax_transformer.config import ConfigError, TransformerConfig, preset

__all__ = ["ConfigError", "TransformerConfig", "preset"]
