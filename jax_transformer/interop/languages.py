"""A new language code in a multilingual model: a special token of the next id in its tokenizer.json, and the
embedding row (and logits bias) that code gets, as transformers' resize_token_embeddings and a copied row make it."""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_transformer.data.tokenizer import LanguageCodeTokenizer, TokenizersJsonTokenizer
from jax_transformer.errors import ConfigError
from jax_transformer.model.params import flatten, unflatten


def with_language(checkpoint, code: str, like: str | None = None):
    """A multilingual model's checkpoint (weights alone) extended by the language `code`: its tokenizer with the
    code as a special token of the next id (`TokenizersJsonTokenizer.with_code`), its vocabulary one larger, the
    new embedding row a copy of `like`'s row (default: the mean of every code's row), and a logits bias, where the
    model has one, extended with `like`'s entry (or the codes' mean), as transformers' resize_token_embeddings and
    a copied row make it. A table with rows beyond the tokenizer's (NLLB-200's has two) gives the code its next
    spare row instead of growing. ConfigError naming the flag for a code that exists, an unknown `like`, or a tokenizer
    without language codes in a tokenizer.json (M2M-100's are numbered after its SentencePiece vocabulary)."""
    tokenizer, config = checkpoint.tokenizer, checkpoint.config
    if not isinstance(tokenizer, TokenizersJsonTokenizer):
        kind = "no language codes" if not isinstance(tokenizer, LanguageCodeTokenizer) else f"{tokenizer.kind}'s codes"
        raise ConfigError(
            f"--add-language: the tokenizer of the model in {checkpoint.directory} has {kind}; new codes are added "
            f"to NLLB-200's and mBART-50's (a tokenizer.json)"
        )
    if code in tokenizer.codes or code in tokenizer.backend.get_vocab(with_added_tokens=True):
        raise ConfigError(f"--add-language {code!r}: the tokenizer has it already (id {tokenizer.codes.get(code)})")
    if like is not None and like not in tokenizer.codes:
        tokenizer.checked_language(like, "--init-from-language")  # a ConfigError-like DataError naming the closest
    extended = tokenizer.with_code(code)
    new_id, size = extended.codes[code], config.src_vocab_size
    if not (config.share_embeddings and config.tie_output and new_id <= size):
        raise ConfigError(
            f"--add-language: the new id {new_id} is beyond the next row of the model's table of {size} (this works "
            f"for one shared, tied table at least the tokenizer's size)"
        )
    rows = [tokenizer.codes[like]] if like is not None else list(tokenizer.codes.values())
    flat = {p: np.array(v) for p, v in flatten(checkpoint.params).items()}
    for path in (("shared_embed", "embedding"), ("logits_bias",)):  # (V, D) and (V,)
        if path not in flat:
            continue
        start = flat[path][rows].mean(axis=0, keepdims=True)
        if new_id == size:
            flat[path] = np.concatenate([flat[path], start])
        else:
            flat[path][new_id] = start[0]
    config = config.replace(src_vocab_size=max(size, new_id + 1), tgt_vocab_size=max(size, new_id + 1))
    return dataclasses.replace(checkpoint, config=config, tokenizer=extended).with_params(unflatten(flat))
