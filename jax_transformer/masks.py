"""Attention masks. Polarity, everywhere in this project: True means "may attend", False means "masked out".

Shapes broadcast against attention scores (B, H, T_query, T_key):
  padding mask (B, 1, 1, T_key)   keys that are real tokens
  causal mask  (1, 1, T, T)       query i sees keys j <= i (the decoder must not look ahead, paper 3.2.3)
"""
import jax.numpy as jnp


def padding_mask(tokens: jnp.ndarray, pad_id: int) -> jnp.ndarray:
    """(B, T) token ids -> (B, 1, 1, T) bool, True where the key is a real token."""
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(length: int) -> jnp.ndarray:
    """(1, 1, T, T) bool lower-triangular: position i may attend to positions 0..i."""
    return jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]


def decoder_self_mask(tgt_in: jnp.ndarray, pad_id: int) -> jnp.ndarray:
    """(B, T) decoder input ids -> (B, 1, T, T): causal and not padding."""
    return padding_mask(tgt_in, pad_id) & causal_mask(tgt_in.shape[1])
