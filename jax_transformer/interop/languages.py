"""A new language code in a multilingual model: a special token of the next id in its tokenizer.json, and the
embedding row (and logits bias) that code gets, as transformers' resize_token_embeddings and a copied row make it."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

import numpy as np

from jax_transformer.data.tokenizer import LanguageCodeTokenizer, TokenizersJsonTokenizer
from jax_transformer.errors import ConfigError
from jax_transformer.model.params import flatten, unflatten


def code_form(code: str) -> str:
    """The form of a language code: each lower-case letter a, upper-case letter A, digit 9, the rest as it is
    (NLLB-200's eng_Latn is aaa_Aaaa, mBART-50's en_XX is aa_AA)."""
    return "".join("a" if c.islower() else "A" if c.isupper() else "9" if c.isdigit() else c for c in code)


def _in_form(code: str, form: str) -> str | None:
    """`code`'s letters and digits laid into `form` (case as the form says, its separators), or None when their
    count differs: the closest code of that form."""
    chars = [c for c in code if c.isalnum()]
    slots = [i for i, f in enumerate(form) if f in "aA9"]
    if len(chars) != len(slots) or any((form[i] == "9") != c.isdigit() for i, c in zip(slots, chars)):
        return None
    out = list(form)
    for i, c in zip(slots, chars):
        out[i] = c.lower() if form[i] == "a" else c.upper() if form[i] == "A" else c
    return "".join(out)


def check_new_code(code: str, codes: Iterable[str], flag: str = "--add-language") -> None:
    """A code to add must have a form of the model's own codes (`code_form`): any other string would become a
    special token that the tokenizer then finds inside ordinary text ("en", "the", "a b"). ConfigError naming the
    forms, an example of each and the closest valid code otherwise."""
    forms = collections.Counter(code_form(c) for c in codes)
    if code_form(code) in forms:
        return
    examples = {form: next(c for c in codes if code_form(c) == form) for form, _ in forms.most_common(3)}
    shown = ", ".join(f"{form} (e.g. {example})" for form, example in examples.items())
    closest = next((found for form, _ in forms.most_common() if (found := _in_form(code, form))), None)
    hint = f"; the closest valid form: {closest}" if closest and closest not in codes else ""
    raise ConfigError(f"{flag} {code!r}: not of the form of this model's language codes, {shown}{hint}")


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
    check_new_code(code, tokenizer.codes)
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
