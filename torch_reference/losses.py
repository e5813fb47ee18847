"""The loss of `jax_transformer.training.losses`, in PyTorch: label-smoothed cross-entropy over non-padding tokens."""

import torch
import torch.nn.functional as F


def loss_sums(
    logits: torch.Tensor, targets: torch.Tensor, pad_id: int, label_smoothing: float = 0.1
) -> dict[str, torch.Tensor]:
    """logits (B, T, V), targets (B, T) -> sums over real tokens: loss (smoothed), nll, tokens, correct."""
    flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    weights = (flat_targets != pad_id).to(logits.dtype)
    loss = F.cross_entropy(
        flat_logits, flat_targets, ignore_index=pad_id, label_smoothing=label_smoothing, reduction="sum"
    )
    nll = F.cross_entropy(flat_logits, flat_targets, ignore_index=pad_id, reduction="sum")
    correct = ((flat_logits.argmax(-1) == flat_targets).to(logits.dtype) * weights).sum()
    return {"loss": loss, "nll": nll, "tokens": weights.sum(), "correct": correct}


def mean_loss(logits: torch.Tensor, targets: torch.Tensor, pad_id: int, label_smoothing: float = 0.1) -> torch.Tensor:
    """Label-smoothed cross-entropy averaged over real (non-padding) target tokens."""
    sums = loss_sums(logits, targets, pad_id, label_smoothing)
    return sums["loss"] / sums["tokens"].clamp(min=1.0)
