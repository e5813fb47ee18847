"""The hashed dropout: the rate it drops, the scaling, independence between elements, sites and keys.

Bounds are statistical: each is at least 6 standard deviations of the quantity under the null hypothesis (bits
independent and uniform), so a correct implementation fails with probability < 1e-8, while a mask that ignores
the key, repeats along an axis or is biased by a few percent fails outright.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_transformer.model.dropout import Dropout, hashed_bits, keep_mask

N = 1 << 20  # elements per mask


def _within(observed: float, expected: float, n: int, p: float) -> bool:
    """|observed - expected| within 6 binomial standard deviations of a mean over n draws of rate p."""
    return abs(observed - expected) <= 6 * np.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5])
def test_drop_rate(rate):
    keep = np.asarray(keep_mask(jax.random.key(0), rate, (N,)))
    assert _within(keep.mean(), 1 - rate, N, rate)


def test_every_bit_is_fair_and_neighbours_are_independent():
    bits = np.asarray(hashed_bits(jax.random.key(1), (N,)), dtype=np.uint64)
    for b in range(32):  # each bit position set half the time
        assert _within(((bits >> b) & 1).mean(), 0.5, N, 0.5), f"bit {b}"
    keep = np.asarray(keep_mask(jax.random.key(1), 0.5, (1024, 1024)))
    for axis in (0, 1):  # along rows and columns: P(kept and neighbour kept) = 1/4
        both = np.logical_and(keep, np.roll(keep, 1, axis=axis)).mean()
        assert _within(both, 0.25, keep.size, 0.25), f"axis {axis}"


def test_masks_depend_on_the_key_only():
    a = np.asarray(keep_mask(jax.random.key(2), 0.5, (N,)))
    assert np.array_equal(a, np.asarray(keep_mask(jax.random.key(2), 0.5, (N,))))  # reproducible
    for other in (jax.random.key(3), jax.random.fold_in(jax.random.key(2), 1)):
        b = np.asarray(keep_mask(other, 0.5, (N,)))
        assert _within(np.mean(a == b), 0.5, N, 0.5)  # unrelated keys agree as often as coin flips
    # A raw uint32[2] key (jax.random.PRNGKey) gives the same bits as the typed key with the same data.
    raw = jax.random.PRNGKey(2)
    assert np.array_equal(
        np.asarray(hashed_bits(raw, (64,))), np.asarray(hashed_bits(jax.random.wrap_key_data(raw), (64,)))
    )


class _TwoSites(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Dropout(0.5)(x, deterministic=False), Dropout(0.5)(x, deterministic=False)


def test_module_scales_kept_values_and_sites_differ():
    x = jnp.full((256, 256), 3.0)
    (first, second) = _TwoSites().apply({}, x, rngs={"dropout": jax.random.key(4)})
    first, second = np.asarray(first), np.asarray(second)
    assert set(np.unique(first)) <= {0.0, 6.0}  # dropped or scaled by 1 / (1 - 0.5)
    assert _within(np.mean(first == second), 0.5, first.size, 0.5)  # two sites, two unrelated masks
    assert np.array_equal(np.asarray(Dropout(0.5).apply({}, x, deterministic=True)), np.asarray(x))
    assert np.array_equal(np.asarray(Dropout(0.0).apply({}, x, deterministic=False)), np.asarray(x))


def test_a_block_of_rows_draws_its_rows_of_the_whole_batch_mask():
    """A pmap device or an accumulation micro-batch sees some rows of the global batch; told which (`global_rows`),
    it must draw exactly those rows of the mask the whole batch would get, so that masks do not depend on how a
    batch is split. Without row ids the index is the flat index, as it always was."""
    from jax_transformer.model.dropout import global_rows

    key, shape = jax.random.key(5), (8, 3, 5, 7)  # (B, H, T, S), like attention probabilities
    whole = np.asarray(keep_mask(key, 0.5, shape))
    assert np.array_equal(np.asarray(hashed_bits(key, shape)), np.asarray(hashed_bits(key, shape, jnp.arange(8))))
    for rows in ([0, 1, 2, 3], [4, 5, 6, 7], [2, 3, 6, 7]):  # a device's block; a micro-batch across two blocks
        part = np.asarray(keep_mask(key, 0.5, (len(rows),) + shape[1:], jnp.array(rows)))
        assert np.array_equal(part, whole[rows])
    # The module reads the row ids from the context, traced or not.
    x = jnp.ones(shape)
    full = np.asarray(Dropout(0.5).apply({}, x, deterministic=False, rngs={"dropout": key}))
    with global_rows(jnp.array([4, 5, 6, 7])):
        block = jax.jit(lambda y: Dropout(0.5).apply({}, y, deterministic=False, rngs={"dropout": key}))(x[:4])
    assert np.array_equal(np.asarray(block), full[4:])
    with pytest.raises(ValueError, match="row ids of shape"):
        keep_mask(key, 0.5, shape, jnp.arange(3))
