"""Dropout (paper 5.4) whose keep/drop bits are a keyed hash of each element's index in the global batch, instead of
`jax.random.bernoulli`: one elementwise fusion, much cheaper on CPU, and the same masks however the batch is split
over devices or micro-batches (`global_rows`). Why and how: docs/internals.md#dropout."""

from __future__ import annotations

import contextlib
import contextvars

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def fmix32(x):
    """MurmurHash3's 32-bit finaliser: a bijection on uint32 in which every input bit affects every output bit (of
    jax's uint32 arrays or numpy's: the products wrap in both)."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


# The global batch row of each row the model sees, set by the training step while it traces the model (see above).
_GLOBAL_ROWS: contextvars.ContextVar = contextvars.ContextVar("dropout_global_rows", default=None)


@contextlib.contextmanager
def global_rows(row_ids):
    """Within this context, row r of every dropout site's input is row `row_ids[r]` of the global batch ((B,)
    integers, traced or not). Used by the training step around the model call; None means rows 0..B-1. Enter it
    inside the function being traced (as `training.train_step` does): a jit cache does not know about it."""
    token = _GLOBAL_ROWS.set(row_ids)
    try:
        yield
    finally:
        _GLOBAL_ROWS.reset(token)


def element_index(shape, row_ids=None) -> jax.Array:
    """uint32 index of each element of `shape` in the global batch: the flat index when row_ids is None, else
    row_ids[r] * (elements per row) + place within the row (arithmetic modulo 2^32, like the flat index)."""
    if row_ids is None:
        return lax.iota(jnp.uint32, int(np.prod(shape, dtype=np.int64))).reshape(shape)
    row_ids = jnp.asarray(row_ids)
    if row_ids.shape != (shape[0],):
        raise ValueError(
            f"dropout: row ids of shape {row_ids.shape} for an input of shape {shape}; expected ({shape[0]},)"
        )
    per_row = int(np.prod(shape[1:], dtype=np.int64))
    within = lax.iota(jnp.uint32, per_row).reshape(shape[1:])
    rows = row_ids.astype(jnp.uint32).reshape((shape[0],) + (1,) * (len(shape) - 1))
    return rows * jnp.uint32(per_row % 2**32) + within


def hashed_bits(key, shape, row_ids=None) -> jax.Array:
    """Pseudo-random uint32 bits of `shape` for a JAX PRNG key (new-style or raw uint32[2]), a function of each
    element's global index (`element_index`)."""
    words = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    words = words.reshape(-1).astype(jnp.uint32)
    index = element_index(shape, row_ids)
    return fmix32(fmix32(index ^ words[0]) + words[-1])


def keep_mask(key, rate: float, shape, row_ids=None) -> jax.Array:
    """Boolean mask, True with probability 1 - rate (rounded to a multiple of 2^-32)."""
    threshold = min(int(round(rate * 2.0**32)), 2**32 - 1)
    return hashed_bits(key, shape, row_ids) >= jnp.uint32(threshold)


class Dropout(nn.Module):
    """Inverted dropout: zero each element with probability `rate`, scale the rest by 1 / (1 - rate)."""

    rate: float

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        if deterministic or self.rate == 0.0:
            return x
        keep = keep_mask(self.make_rng("dropout"), self.rate, x.shape, _GLOBAL_ROWS.get())
        return jnp.where(keep, x / (1.0 - self.rate), jnp.zeros_like(x))
