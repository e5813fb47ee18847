"""The training step of `jax_transformer.training.trainer`, in PyTorch: the same schedule, optimiser and loss, read from
the same `OptimConfig`, so that a run can be compared with the Flax one step by step
(parity_tests/test_training_parity.py).

    optimizer, scheduler = make_optimizer(model, opt)           # opt: jax_transformer.settings.config.OptimConfig
    for batch in batches:
        sums = train_step(model, optimizer, scheduler, batch, opt)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import nn

from jax_transformer.errors import ConfigError
from jax_transformer.settings.config import OptimConfig
from torch_reference.losses import loss_sums

# Packed batches carry these too (see jax_transformer.training.trainer.PACKING_KEYS).
PACKING_KEYS = ("src_segments", "tgt_segments", "src_positions", "tgt_positions")


def noam_rate(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """The paper's learning rate (section 5.3) for update number `step` (1, 2, ...):
    scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def noam_lambda(d_model: int, warmup_steps: int, scale: float = 1.0) -> Callable[[int], float]:
    """The multiplier for torch.optim.lr_scheduler.LambdaLR (base lr 1.0). LambdaLR passes the number of
    scheduler.step() calls so far, 0 for the first update; the paper numbers that update 1."""
    return lambda calls: noam_rate(calls + 1, d_model, warmup_steps, scale)


def make_optimizer(model: nn.Module, opt: OptimConfig, **implementation):
    """Adam(b1, b2, eps) -- AdamW with decoupled decay on weight matrices when weight_decay > 0, as optax's adamw
    with the same mask -- under LambdaLR with the paper's schedule for the model's d_model. `implementation`
    passes torch's choice of kernels through (foreach=True, fused=True). Returns (optimizer, scheduler)."""
    adam = dict(lr=1.0, betas=(opt.b1, opt.b2), eps=opt.eps, **implementation)
    if opt.weight_decay:
        matrices = [p for p in model.parameters() if p.ndim > 1]
        others = [p for p in model.parameters() if p.ndim <= 1]
        groups = [{"params": matrices, "weight_decay": opt.weight_decay}, {"params": others, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, **adam)
    else:
        optimizer = torch.optim.Adam(model.parameters(), **adam)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_lambda(model.cfg.d_model, opt))


def schedule_lambda(d_model: int, opt: OptimConfig) -> Callable[[int], float]:
    """LambdaLR's factor (lr=1.0) after `calls` scheduler steps: the paper's schedule, or a fine-tuning one (a
    linear warm-up from 0 to opt.lr, then constant, linear or cosine decay to 0 at opt.decay_steps, or
    lr * sqrt(warmup / step)), written as transformers' optimization module writes them."""
    if opt.schedule == "noam":
        return noam_lambda(d_model, opt.warmup_steps, opt.lr_scale)
    peak, warmup, total = opt.lr, opt.warmup_steps, opt.decay_steps
    if opt.schedule in ("linear", "cosine") and total is None:
        raise ConfigError(f"optimiser field 'decay_steps' is needed with --schedule {opt.schedule} (--decay-steps)")

    def factor(calls: int) -> float:
        if calls < warmup:
            return peak * calls / warmup
        if opt.schedule == "constant":
            return peak
        if opt.schedule == "inverse_sqrt":
            return peak * math.sqrt(warmup / calls)
        progress = min(1.0, (calls - warmup) / (total - warmup))
        return peak * (1.0 - progress if opt.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress)))

    return factor


def _as_tensor(x, device: torch.device) -> torch.Tensor:
    """Token ids (numpy or torch) as a long tensor on the model's device."""
    x = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x, dtype=np.int64))
    return x.to(device=device, dtype=torch.long)


def keep_start_row(model: nn.Module) -> None:
    """Marian's convention (the decoder starts from the pad token): the pad row of the target embedding, the
    decoder's start vector, gets no gradient through the tied output projection either (as
    jax_transformer.training.trainer.keep_start_row), so that it stays zero as Marian and CTranslate2 take it to be."""
    cfg = model.cfg
    if cfg.decoder_start_id != cfg.pad_id or not cfg.tie_output:
        return
    grad = model._embedding("target").weight.grad
    if grad is not None:
        grad[cfg.pad_id] = 0.0


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    batch: Mapping[str, object],
    opt: OptimConfig,
    autocast: torch.dtype | None = None,
) -> dict[str, float]:
    """One update on a batch of src / tgt_in / tgt_out ids (numpy or torch; packed rows with PACKING_KEYS too):
    label-smoothed cross-entropy averaged over real target tokens, backward, optional gradient-norm clipping, Adam
    step, schedule step. Returns the batch's loss sums (before the update) as floats. Dropout follows
    model.train()/eval(). `model` may be wrapped (torch.compile); its config is read off the unwrapped module. The
    step runs on the model's device (the batch is moved there) in its config's compute dtype (`config.dtype`).
    `autocast` (benchmarks only) runs the forward pass and loss under torch.autocast to that dtype: PyTorch's usual
    mixed precision, which is not the twin's policy (see torch_reference.model), to compare speeds with."""
    cfg = getattr(model, "_orig_mod", model).cfg
    device = next(model.parameters()).device
    src, tgt_in, tgt_out = (_as_tensor(batch[k], device) for k in ("src", "tgt_in", "tgt_out"))
    packing = {k: _as_tensor(batch[k], device) for k in PACKING_KEYS if k in batch}  # packed rows
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        logits = model(src, tgt_in, **packing)  # (B, T, V)
        sums = loss_sums(logits.float(), tgt_out, cfg.pad_id, opt.label_smoothing)
    (sums["loss"] / sums["tokens"].clamp(min=1.0)).backward()
    keep_start_row(getattr(model, "_orig_mod", model))
    if opt.clip_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.clip_norm)
    optimizer.step()
    scheduler.step()
    return {k: float(v.detach()) for k, v in sums.items()}
