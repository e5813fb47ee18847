"""Attention masks, True = may attend everywhere: padding (B, 1, 1, Tk), causal (1, 1, T, T) and, for packed rows,
segment masks (B, 1, Tq, Tk) that keep attention within one sentence pair."""

import jax.numpy as jnp


def padding_mask(tokens: jnp.ndarray, pad_id: int) -> jnp.ndarray:
    """(B, T) token ids -> (B, 1, 1, T) bool, True where the key is a real token."""
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(length: int) -> jnp.ndarray:
    """(1, 1, T, T) bool lower-triangular: position i may attend to positions 0..i."""
    return jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]


def decoder_self_mask(tgt_in: jnp.ndarray, pad_id: int) -> jnp.ndarray:
    """(B, T) decoder input ids -> (B, 1, T, T): causal and not padding. The first position is the decoder's start
    token, a real key whatever its id (Marian starts the decoder from the pad id)."""
    first = jnp.arange(tgt_in.shape[1]) == 0
    return (padding_mask(tgt_in, pad_id) | first[None, None, None, :]) & causal_mask(tgt_in.shape[1])


def segment_mask(query_segments: jnp.ndarray, key_segments: jnp.ndarray) -> jnp.ndarray:
    """(B, Tq), (B, Tk) segment ids (0 = padding) -> (B, 1, Tq, Tk) bool: True where the key is real and belongs
    to the query's own pair."""
    same = query_segments[:, :, None] == key_segments[:, None, :]  # (B, Tq, Tk)
    return (same & (key_segments != 0)[:, None, :])[:, None]


def encoder_mask(src: jnp.ndarray, pad_id: int, src_segments=None) -> jnp.ndarray:
    """Encoder self-attention: real keys of the same pair; (B, 1, 1, S) unpacked, (B, 1, S, S) packed."""
    return padding_mask(src, pad_id) if src_segments is None else segment_mask(src_segments, src_segments)


def decoder_masks(src, tgt_in, pad_id: int, src_segments=None, tgt_segments=None):
    """(decoder self-attention mask, cross-attention mask): causal within the pair, and the pair's own source."""
    if tgt_segments is None:
        return decoder_self_mask(tgt_in, pad_id), padding_mask(src, pad_id)
    self_mask = segment_mask(tgt_segments, tgt_segments) & causal_mask(tgt_in.shape[1])
    return self_mask, segment_mask(tgt_segments, src_segments)
