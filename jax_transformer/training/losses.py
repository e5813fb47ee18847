"""Label-smoothed cross-entropy over non-padding target tokens (paper 5.4, epsilon_ls = 0.1).

Smoothing follows optax/torch: the target distribution is (1 - eps) * one_hot + eps / V over all V classes, so
`torch.nn.functional.cross_entropy(..., label_smoothing=eps)` in the twin computes the same number.

Functions return *sums* and token counts rather than means, so data-parallel steps can add them over devices
(`lax.psum`) and divide once: a pmap step then equals the single-device step on the whole batch.
"""

import jax
import jax.numpy as jnp

from jax_transformer import checks


def loss_sums(logits, targets, pad_id: int, label_smoothing: float = 0.1) -> dict[str, jnp.ndarray]:
    """logits (B, T, V), targets (B, T) -> {"loss": smoothed CE summed over real tokens, "nll": unsmoothed
    negative log-likelihood sum (for perplexity), "tokens": real-token count, "correct": argmax hits}.
    A target id outside [0, V) is a TokenError (concrete arrays) or a checkify debug check (traced ones)."""
    _check_targets(logits, targets)
    weights = (targets != pad_id).astype(logits.dtype)  # (B, T)
    # With q = (1 - eps) one_hot(y) + eps / V, the cross-entropy -sum_c q_c log p_c equals
    #   (1 - eps) * (lse - logit_y) + eps * (lse - mean_c logit_c),   lse = logsumexp(logits),
    # which needs no (B, T, V) one-hot or log-probability tensor: the same number as
    # optax.softmax_cross_entropy(logits, optax.smooth_labels(one_hot, eps)) at a fraction of the memory traffic.
    lse = jax.nn.logsumexp(logits, axis=-1)  # (B, T)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # (B, T)
    nll = lse - target_logit
    loss = (
        nll
        if not label_smoothing
        else (1.0 - label_smoothing) * nll + label_smoothing * (lse - jnp.mean(logits, axis=-1))
    )
    # A hit is a target logit equal to the row's maximum: the max logsumexp takes anyway, where an argmax would
    # be a second, costlier (value, index) reduction over V. (Exact ties, which argmax breaks by index, count.)
    correct = (target_logit >= jnp.max(logits, axis=-1)).astype(logits.dtype)
    return {
        "loss": jnp.sum(loss * weights),
        "nll": jnp.sum(nll * weights),
        "tokens": jnp.sum(weights),
        "correct": jnp.sum(correct * weights),
    }


def _check_targets(logits, targets) -> None:
    if logits.ndim != targets.ndim + 1 or tuple(logits.shape[:-1]) != tuple(targets.shape):
        raise checks.TokenError(
            f"targets have shape {targets.shape}, logits {logits.shape}: expected (B, T) and (B, T, V)"
        )
    if targets.ndim != 2:
        return  # the token checks name (row, column) positions; other layouts are the caller's to check
    if checks.is_traced(targets):
        checks.debug_check_ids("targets", targets, logits.shape[-1])
    else:
        checks.check_ids("targets", targets, logits.shape[-1])


def mean_loss(logits, targets, pad_id: int, label_smoothing: float = 0.1) -> jnp.ndarray:
    """Label-smoothed cross-entropy averaged over real (non-padding) target tokens."""
    sums = loss_sums(logits, targets, pad_id, label_smoothing)
    return sums["loss"] / jnp.maximum(sums["tokens"], 1.0)
