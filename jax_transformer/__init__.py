"""The original encoder-decoder Transformer in Flax linen, with a PyTorch twin (docs/design.md: the tour).

    from jax_transformer import Translator
    translator = Translator("runs/de-en")              # a run directory: trained here, or `train.py import`ed
    translator.translate(["Ein Hund läuft."], beam_size=4, n_best=2)

Importing this package imports neither jax nor torch: the settings (`jax_transformer.settings`) are plain Python,
and `Translator` loads the model's code (jax, flax) on first use. The sub-packages, one concern each: settings,
model, data, checkpoint, decoding, serving, interop, training and cli (each `__init__` says what it holds).
"""

from jax_transformer.settings.config import ConfigError, TransformerConfig, preset

__all__ = ["ConfigError", "Translator", "TransformerConfig", "preset"]


def __getattr__(name: str):
    if name == "Translator":  # imported on first use: it brings jax and flax
        from jax_transformer.decoding.translator import Translator

        return Translator
    raise AttributeError(f"module 'jax_transformer' has no attribute {name!r}")
