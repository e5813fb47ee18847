"""Lexical constraints in the service: a request's `constraints` (a list of phrases per text) and the operator's
`--glossary`, checked before anything is decoded, as each sentence's phrases (`decoding.constraints`). Every
sentence's phrases are padded to the one size of --constraint-size (P phrases of M tokens), whose programs the
service compiled before it said ready, so no request compiles.

- A request's phrases: a text of one sentence only (the service would not know which of several sentences a
  phrase belongs to); at most P phrases (and one per beam) of at most M tokens each, none empty, none of characters
  the target vocabulary does not know, and no more tokens in all than the sentence may produce: else a 400 naming
  `constraints[i][j]`. Greedy search and sampling take none.
- The glossary: each entry's target term is checked at start (at most M tokens, known characters: else the
  service does not start). A sentence's terms follow its request's own phrases; those past what the sentence can
  take (P phrases, one per beam, its length) are left out, the first that fit kept, and a line says so in the log.
  Requests decoded by greedy search or sampling take no terms.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from jax_transformer.errors import ConfigError
from jax_transformer.serving.errors import HTTPError
from jax_transformer.settings.config import DecodeConfig

log = logging.getLogger("jax_transformer.serving")


def takes_phrases(decode: DecodeConfig) -> bool:
    """Whether this decoding can hold phrases: a beam search of 2 or more, no sampling."""
    return decode.beams > 1 and not decode.do_sample


def _phrase_ids(tokenizer, text: str) -> list[int] | None:
    """A phrase's ids, None where it is empty or holds characters the target vocabulary does not know."""
    from jax_transformer.data.tokenizer import UNK_ID, Tokenizer
    from jax_transformer.decoding.translation import encode_phrase

    if not text.strip():
        return None
    ids = encode_phrase(tokenizer, text)
    unk = getattr(tokenizer, "unk_id", UNK_ID if isinstance(tokenizer, Tokenizer) else None)
    return ids if ids and (unk is None or unk not in ids) else None


def check_glossary(glossary, decode: DecodeConfig, tokenizer, origin: str) -> None:
    """A ConfigError naming the glossary's entry whose target term no sentence could take (more than M tokens,
    characters the target vocabulary does not know), or a glossary without --constraint-size or beam search."""
    size = decode.phrase_size()
    if size is None:
        raise ConfigError(
            f"--glossary {origin}: needs --constraint-size PxM (the padded size of every sentence's terms)"
        )
    if not takes_phrases(decode):
        raise ConfigError(f"--glossary {origin}: its terms are constraints, which need beam search (--beam-size 2+)")
    for n, (source, target) in enumerate(glossary.entries, 1):
        ids = _phrase_ids(tokenizer, target)
        if ids is None:
            raise ConfigError(f"--glossary {origin}, entry {n} ({source!r}): {target!r} has characters the target "
                              f"vocabulary does not know")  # fmt: skip
        if len(ids) > size[1]:
            raise ConfigError(f"--glossary {origin}, entry {n} ({source!r}): {target!r} is {len(ids)} tokens, more "
                              f"than --constraint-size {decode.constraint_size} takes ({size[1]})")  # fmt: skip


def request_phrases(value: Any, texts: list[str], one: bool, decode: DecodeConfig, tokenizer) -> list | None:
    """The request's `constraints` field as a list of phrases (or None) per text, each phrase checked (a 400
    naming `constraints[i][j]` otherwise), or None where it gives none."""
    if value is None:
        return None
    if one and isinstance(value, list) and all(isinstance(p, str) for p in value):
        value = [value]  # one text: its phrases as one list
    if not isinstance(value, list) or len(value) != len(texts):
        raise HTTPError(400, f"constraints: expected a list of phrase lists, one per text ({len(texts)})")
    size = decode.phrase_size()
    if any(value) and size is None:
        raise HTTPError(
            400,
            "constraints: this service takes none (it compiles them at start, and was started without a size)",
        )
    if any(value) and not takes_phrases(decode):
        raise HTTPError(400, "constraints: they need beam search (beam_size 2 or more, no sampling)")
    out = []
    for i, phrases in enumerate(value):
        if phrases is None or phrases == []:
            out.append(None)
            continue
        if not isinstance(phrases, list):
            raise HTTPError(
                400, f"constraints[{i}]: expected a list of phrases (strings), got {type(phrases).__name__}"
            )
        most = min(size[0], decode.beams)
        if len(phrases) > most:
            raise HTTPError(400, f"constraints[{i}]: {len(phrases)} phrases, more than this service takes "
                                 f"({most}: its compiled size {decode.constraint_size}, one per beam of "
                                 f"{decode.beams})")  # fmt: skip
        for j, text in enumerate(phrases):
            where = f"constraints[{i}][{j}]"
            if not isinstance(text, str):
                raise HTTPError(400, f"{where}: expected a phrase (a string), got {type(text).__name__}")
            ids = _phrase_ids(tokenizer, text)
            if ids is None:
                raise HTTPError(400, f"{where} {text!r}: empty, or characters the target vocabulary does not know")
            if len(ids) > size[1]:
                raise HTTPError(400, f"{where} {text!r}: {len(ids)} tokens, more than this service takes ({size[1]}: "
                                     f"its compiled size {decode.constraint_size})")  # fmt: skip
        out.append(list(phrases))
    return out if any(out) else None


def sentence_phrases(
    pieces: Sequence[Sequence[Any]],
    given: list | None,
    glossary,
    decode: DecodeConfig,
    tokenizer,
    rooms: Sequence[int],
) -> list | None:
    """Each sentence's phrases (in the order of the texts' sentences; None where none): a text's own phrases (a
    400 where it holds more than one sentence, or its phrases more tokens than the sentence may produce: `rooms`)
    and the glossary's terms of the sentence that still fit."""
    glossary = glossary if takes_phrases(decode) else None
    if given is None and glossary is None:
        return None
    size = decode.phrase_size()
    out, at = [], 0
    for i, each in enumerate(pieces):
        sentences = [piece.text for piece in each if piece.sentence]
        own = given[i] if given is not None else None
        if own and len(sentences) != 1:
            raise HTTPError(400, f"constraints[{i}]: constraints need a text of one sentence (this one has "
                                 f"{len(sentences)}); send its sentences as separate texts")  # fmt: skip
        for sentence in sentences:
            phrases = list(own or [])
            used = sum(len(_phrase_ids(tokenizer, p)) for p in phrases)
            if used > rooms[at]:
                raise HTTPError(400, f"constraints[{i}]: its phrases have {used} tokens, more than the {rooms[at]} "
                                     f"this sentence may produce")  # fmt: skip
            if glossary is not None:
                left = []
                for term in glossary.terms(sentence):
                    if term in phrases:
                        continue
                    ids = _phrase_ids(tokenizer, term)  # (checked at start, with the first pair's tokenizer)
                    n = len(ids) if ids is not None and len(ids) <= size[1] else rooms[at] + 1
                    if len(phrases) < min(size[0], decode.beams) and used + n <= rooms[at]:
                        phrases.append(term)
                        used += n
                    else:
                        left.append(term)
                if left:
                    log.warning("glossary: %d term(s) left out of a sentence, past what it takes: %s", len(left), left)
            out.append(phrases or None)
            at += 1
    return out if any(out) else None
