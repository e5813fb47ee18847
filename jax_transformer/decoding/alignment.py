"""Word alignments from cross-attention, as fairseq's `--print-alignment` makes them: each target token is aligned
to the source token that a chosen decoder layer's cross-attention, averaged over its heads, weighs most (the search
keeps that position per token: `search.advance_alignment`; scoring asks a teacher-forced pass: `token_alignments`),
PAD and EOS left out of the choice (fairseq's `extract_hard_alignment`). Tokens are then mapped to words: a pair
"i-j" (Pharaoh format, 0-based, source first) for each source word i and target word j such that some subword of j
is aligned to some subword of i, sorted and each once. Words are what the tokenizer's pieces say: a piece that
begins with "▁" (SentencePiece: this project's, Marian's, NLLB's, M2M-100's, mBART's) or that follows one ending
in "</w>" (FSMT's BPE) begins a word, as does a sentence's first real piece. Special tokens are no words: PAD, EOS,
BOS, and the language codes of multilingual models (a source's code, the forced first target token) and Marian's
>>xx<<; a target token aligned to one of them gives no pair. A target prefix's tokens are words of the output like
any other: they are aligned. docs/decoding.md#word-alignments."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jax_transformer.compilation import jit_by_config
from jax_transformer.data.tokenizer import Tokenizer
from jax_transformer.decoding.search import first_argmax
from jax_transformer.model.transformer import Transformer, cross_attention_rows
from jax_transformer.settings.config import TransformerConfig


def _piece(tokenizer, index: int, side: str) -> str:
    if isinstance(tokenizer, Tokenizer):  # one joint vocabulary: no side
        return tokenizer.piece(index)
    return tokenizer.piece(index, side)


def special_ids(tokenizer, config: TransformerConfig) -> set[int]:
    """The ids that are no words: PAD, EOS, BOS and the tokenizer's language codes."""
    ids = {config.pad_id, config.eos_id} | ({config.bos_id} if config.bos_id is not None else set())
    return ids | set(getattr(tokenizer, "codes", {}).values())


def word_indices(tokenizer, ids: Sequence[int], side: str, config: TransformerConfig) -> list[int]:
    """The word each token of `ids` (a source's, side "source", or an output's, "target") belongs to, counted from 0
    over the sentence's words; -1 for a special token (`special_ids`, Marian's >>xx<<)."""
    specials, out = special_ids(tokenizer, config), []
    word, ended = -1, True  # `ended`: the piece before closed its word (or there was none)
    for i in (int(x) for x in ids):
        piece = _piece(tokenizer, i, side)
        if i in specials or (piece.startswith(">>") and piece.endswith("<<")):
            out.append(-1)
            continue
        if ended or piece.startswith("\u2581"):
            word += 1
        ended = piece.endswith("</w>")
        out.append(word)
    return out


def word_pairs(source_words: Sequence[int], target_words: Sequence[int], aligned: Sequence[int]) -> list[tuple]:
    """(source word, target word) pairs, sorted, each once: target token t (word `target_words[t]`) aligned to
    source token `aligned[t]` (-1: none), for tokens of both sides that are words (index >= 0)."""
    pairs = set()
    for target_word, position in zip(target_words, aligned):
        if target_word >= 0 and 0 <= position < len(source_words) and source_words[position] >= 0:
            pairs.add((source_words[position], target_word))
    return sorted(pairs)


def pharaoh(pairs: Sequence[tuple[int, int]]) -> str:
    """Pairs as fast_align, Marian and fairseq print them: "0-0 1-2 ..."."""
    return " ".join(f"{i}-{j}" for i, j in pairs)


def sentence_alignment(
    tokenizer, config: TransformerConfig, source: Sequence[int], target: Sequence[int], aligned: Sequence[int]
) -> str:
    """The Pharaoh word alignment of one hypothesis: `source` the ids the model read (codes and EOS included),
    `target` its output's ids, `aligned` (len(target),) the source position each output token is aligned to."""
    source_words = word_indices(tokenizer, source, "source", config)
    target_words = word_indices(tokenizer, target, "target", config)
    return pharaoh(word_pairs(source_words, target_words, aligned))


@functools.partial(jit_by_config, static_argnames=("config", "layer"))
def token_alignments(params, src, tgt_in, *, config: TransformerConfig, layer: int):
    """(B, T) the source position each target token is aligned to, teacher-forced: decoder layer `layer`'s
    cross-attention for src (B, S) and tgt_in (B, T) averaged over heads, its argmax over the positions of source
    tokens that are not PAD or EOS (as the search's)."""
    _, state = Transformer(config).apply({"params": params}, src, tgt_in, mutable=["intermediates"])
    attention = cross_attention_rows(state["intermediates"], layer, src.shape[0])  # (B, T, S)
    words = (src != config.pad_id) & (src != config.eos_id)  # (B, S)
    return first_argmax(jnp.where(words[:, None, :], attention, -1.0))


def teacher_forced_alignments(
    params, config: TransformerConfig, layer: int, src: np.ndarray, tgt_in: np.ndarray
) -> np.ndarray:
    """`token_alignments` on the host, for padded batches src (B, S) and tgt_in (B, T)."""
    found = token_alignments(params, jnp.asarray(src, jnp.int32), jnp.asarray(tgt_in, jnp.int32), config=config,
                             layer=layer)  # fmt: skip
    return np.asarray(found)
