"""Label-smoothed cross-entropy over non-padding target tokens (paper 5.4, epsilon_ls = 0.1).

Smoothing follows optax/torch: the target distribution is (1 - eps) * one_hot + eps / V over all V classes, so
`torch.nn.functional.cross_entropy(..., label_smoothing=eps)` in the twin computes the same number.

Functions return *sums* and token counts rather than means, so data-parallel steps can add them over devices
(`lax.psum`) and divide once: a pmap step then equals the single-device step on the whole batch.
"""
import jax
import jax.numpy as jnp
import optax


def loss_sums(logits, targets, pad_id: int, label_smoothing: float = 0.1) -> dict[str, jnp.ndarray]:
    """logits (B, T, V), targets (B, T) -> {"loss": smoothed CE summed over real tokens, "nll": unsmoothed
    negative log-likelihood sum (for perplexity), "tokens": real-token count, "correct": argmax hits}."""
    weights = (targets != pad_id).astype(logits.dtype)  # (B, T)
    one_hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)  # (B, T, V)
    smoothed = optax.smooth_labels(one_hot, label_smoothing) if label_smoothing else one_hot
    loss = optax.softmax_cross_entropy(logits, smoothed)  # (B, T)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # (B, T)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(logits.dtype)
    return {"loss": jnp.sum(loss * weights), "nll": jnp.sum(nll * weights),
            "tokens": jnp.sum(weights), "correct": jnp.sum(correct * weights)}


def mean_loss(logits, targets, pad_id: int, label_smoothing: float = 0.1) -> jnp.ndarray:
    """Label-smoothed cross-entropy averaged over real (non-padding) target tokens."""
    sums = loss_sums(logits, targets, pad_id, label_smoothing)
    return sums["loss"] / jnp.maximum(sums["tokens"], 1.0)
