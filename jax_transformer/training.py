"""Training the Transformer with optax: the paper's optimiser and schedule, jitted (or pmapped) steps, evaluation.

Read top to bottom, this module follows one optimisation step:

1. `OptimConfig`, `noam_rate`, `make_optimizer`: Adam(0.9, 0.98, 1e-9) with the warmup-then-inverse-square-root
   learning rate of paper section 5.3, optional gradient clipping and decoupled weight decay.
2. `TrainState`, `create_train_state`: everything a step changes (step, params, optimiser state) plus the base
   dropout key. One pytree, so a checkpoint saves it whole and a jitted step can donate it.
3. `train_step` / `make_train_step`: label-smoothed cross-entropy summed over real target tokens, gradients of
   that sum, combined over devices with `lax.psum` under pmap, divided by the *global* token count, one update.
4. `make_eval_step`, `evaluate_loss`, `evaluate_translations`: loss / perplexity / accuracy on validation
   batches, and BLEU / chrF (sacrebleu) on decoded sentences.
5. `Trainer`: the loop that ties these to a BatchStream, checkpoints, metrics files and a progress bar.

Randomness: the dropout key of step s is fold_in(base_key, s) (and, under pmap, fold_in of that with the device
index), so it depends only on the step number: a run resumed from a checkpoint draws exactly the same masks.
"""
from __future__ import annotations

import dataclasses
import json
import math
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jax_transformer.config import TransformerConfig
from jax_transformer.losses import loss_sums
from jax_transformer.model import Transformer

AXIS = "devices"  # pmap axis name used by the data-parallel step


class TrainingError(RuntimeError):
    """Training cannot go on (for example the loss became NaN); the message says at which step and why."""


# =============================================================================================================
# 1. Optimiser and learning-rate schedule
# =============================================================================================================


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimiser settings. The defaults are the paper's (section 5.3), except `lr_scale` which multiplies the
    whole schedule (the paper's is 1.0; small models and short runs often want 1-2)."""

    lr_scale: float = 1.0
    warmup_steps: int = 4000
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-9
    clip_norm: float | None = None  # clip the global gradient norm to this (None: no clipping)
    weight_decay: float = 0.0  # decoupled weight decay (AdamW) on matrices; 0 means plain Adam
    label_smoothing: float = 0.1  # epsilon_ls of paper section 5.4

    def __post_init__(self) -> None:
        if self.warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {self.warmup_steps}")
        if not self.lr_scale > 0:
            raise ValueError(f"lr_scale must be > 0, got {self.lr_scale}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0 (or None for no clipping), got {self.clip_norm}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "OptimConfig":
        return cls(**dict(values))


def noam_rate(step, d_model: int, warmup_steps: int, scale: float = 1.0):
    """The paper's learning rate for the update numbered `step` (1, 2, ...):
    lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5). Works on Python numbers and jnp arrays."""
    xp = jnp if isinstance(step, jax.Array) else np
    step = xp.maximum(xp.asarray(step, dtype=xp.float32), 1.0)
    return scale * d_model ** -0.5 * xp.minimum(step ** -0.5, step * warmup_steps ** -1.5)


def learning_rate_schedule(d_model: int, opt: OptimConfig) -> optax.Schedule:
    """An optax schedule. optax calls it with the number of updates already applied (0 for the first update),
    the paper counts from 1: the first update uses noam_rate(1)."""
    return lambda count: noam_rate(count + 1, d_model, opt.warmup_steps, opt.lr_scale)


def _decay_mask(params):
    # Decay weight matrices and embeddings only; biases and LayerNorm scales are left alone (common practice).
    return jax.tree_util.tree_map(lambda p: p.ndim > 1, params)


def make_optimizer(config: TransformerConfig, opt: OptimConfig) -> optax.GradientTransformation:
    """Adam(b1, b2, eps) on the paper's schedule; clip_by_global_norm first if asked; AdamW if weight_decay > 0."""
    schedule = learning_rate_schedule(config.d_model, opt)
    if opt.weight_decay:
        adam = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay,
                           mask=_decay_mask)
    else:
        adam = optax.adam(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps)
    if opt.clip_norm is not None:
        return optax.chain(optax.clip_by_global_norm(opt.clip_norm), adam)
    return adam


# =============================================================================================================
# 2. Train state
# =============================================================================================================


class TrainState(flax.struct.PyTreeNode):
    """Everything one step reads and writes. `step` counts updates applied so far (an int32 scalar array, so
    the state is a pure pytree); `dropout_key` is the run's base key and never changes."""

    step: jax.Array
    params: Any
    opt_state: Any
    dropout_key: jax.Array


def create_train_state(config: TransformerConfig, opt: OptimConfig, *, seed: int = 0, params=None) -> TrainState:
    """A fresh state: params from `init_params(config, seed)` unless given (e.g. ported from PyTorch)."""
    from jax_transformer.model import init_params

    if params is None:
        params = init_params(config, seed)
    params = jax.tree_util.tree_map(jnp.asarray, params)
    tx = make_optimizer(config, opt)
    # The dropout key is derived from the seed but kept apart from the init key (fold_in 1).
    dropout_key = jax.random.fold_in(jax.random.PRNGKey(seed), 1)
    return TrainState(step=jnp.array(0, jnp.int32), params=params, opt_state=tx.init(params),
                      dropout_key=dropout_key)


def abstract_train_state(config: TransformerConfig, opt: OptimConfig) -> TrainState:
    """Shapes and dtypes of a train state (nothing allocated): the restore target for checkpoints."""
    return jax.eval_shape(lambda: create_train_state(config, opt))


# =============================================================================================================
# 3. The training step
# =============================================================================================================


def batch_loss_sums(params, batch: Mapping[str, jax.Array], config: TransformerConfig, label_smoothing: float,
                    dropout_key=None) -> dict[str, jax.Array]:
    """Teacher-forced forward pass -> summed loss statistics over the batch's real target tokens.
    Dropout is on when a key is given (training), off otherwise (evaluation)."""
    deterministic = dropout_key is None
    rngs = None if deterministic else {"dropout": dropout_key}
    logits = Transformer(config).apply({"params": params}, batch["src"], batch["tgt_in"],
                                       deterministic=deterministic, rngs=rngs)  # (B, T, V)
    return loss_sums(logits, batch["tgt_out"], config.pad_id, label_smoothing)


def train_step(state: TrainState, batch, *, config: TransformerConfig, tx: optax.GradientTransformation,
               label_smoothing: float, dropout: bool = True, axis_name: str | None = None):
    """One optimiser update. Returns (new state, the batch's loss sums before the update).

    Data parallel (axis_name given, inside pmap): each device differentiates the *sum* of its tokens' losses,
    the sums and gradients are added over devices with psum, and only then divided by the global number of
    real tokens. The update therefore equals the single-device update on the whole batch (up to the order of
    float additions), whereas averaging per-device means would weight a device's tokens by 1 / its own count.
    """
    key = jax.random.fold_in(state.dropout_key, state.step)  # depends only on the step: resume is exact
    if axis_name is not None:
        key = jax.random.fold_in(key, lax.axis_index(axis_name))  # a different dropout mask on each device

    def summed_loss(params):
        sums = batch_loss_sums(params, batch, config, label_smoothing, key if dropout else None)
        return sums["loss"], sums

    grads, sums = jax.grad(summed_loss, has_aux=True)(state.params)
    if axis_name is not None:
        grads, sums = lax.psum((grads, sums), axis_name)
    tokens = jnp.maximum(sums["tokens"], 1.0)  # an all-padding batch has no tokens: avoid 0 / 0
    grads = jax.tree_util.tree_map(lambda g: g / tokens, grads)  # gradient of the mean loss per real token
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), sums


def make_train_step(config: TransformerConfig, opt: OptimConfig, *, n_devices: int = 1, dropout: bool = True):
    """The compiled step: `jax.jit` on one device, `jax.pmap` over `n_devices` local devices otherwise.
    The state argument is donated (its buffers are reused for the new state), so callers must not use the
    state they passed in after the call. Under pmap the state is replicated and the batch has a leading
    device axis (see `replicate`, `shard_batch`)."""
    tx = make_optimizer(config, opt)
    if n_devices == 1:
        fn = lambda state, batch: train_step(state, batch, config=config, tx=tx,  # noqa: E731
                                              label_smoothing=opt.label_smoothing, dropout=dropout)
        return jax.jit(fn, donate_argnums=0)
    fn = lambda state, batch: train_step(state, batch, config=config, tx=tx,  # noqa: E731
                                          label_smoothing=opt.label_smoothing, dropout=dropout, axis_name=AXIS)
    return jax.pmap(fn, axis_name=AXIS, donate_argnums=0)


def make_eval_step(config: TransformerConfig, label_smoothing: float, *, n_devices: int = 1):
    """Compiled evaluation: (params, batch) -> loss sums, dropout off. Params are not donated (they live on)."""
    if n_devices == 1:
        return jax.jit(lambda params, batch: batch_loss_sums(params, batch, config, label_smoothing))
    return jax.pmap(lambda params, batch: lax.psum(batch_loss_sums(params, batch, config, label_smoothing), AXIS),
                    axis_name=AXIS)


def shard_batch(batch: Mapping[str, np.ndarray], n_devices: int) -> dict[str, np.ndarray]:
    """(B, L) arrays -> (n_devices, B / n_devices, L): each device gets a contiguous block of rows."""
    if n_devices == 1:
        return dict(batch)
    out = {}
    for key, value in batch.items():
        if value.shape[0] % n_devices:
            raise ValueError(f"batch[{key!r}] has {value.shape[0]} rows, not divisible by {n_devices} devices; "
                             f"build the BatchStream with row_multiple={n_devices}")
        out[key] = value.reshape(n_devices, value.shape[0] // n_devices, *value.shape[1:])
    return out


def replicate(tree, n_devices: int):
    """A pytree copied onto each of the first n local devices (leading axis n) for pmap; unchanged for n=1."""
    if n_devices == 1:
        return tree
    import flax.jax_utils

    return flax.jax_utils.replicate(tree, devices=jax.local_devices()[:n_devices])


def unreplicate(tree, n_devices: int):
    """The first device's copy of a replicated pytree (they are equal); unchanged for n=1."""
    if n_devices == 1:
        return tree
    return jax.tree_util.tree_map(lambda x: x[0], tree)


def summarize(sums: Mapping[str, Any]) -> dict[str, float]:
    """Loss sums -> per-token numbers: loss (smoothed), nll, perplexity = exp(mean nll), accuracy, tokens."""
    tokens = float(sums["tokens"])
    denom = max(tokens, 1.0)
    nll = float(sums["nll"]) / denom
    return {"loss": float(sums["loss"]) / denom, "nll": nll, "ppl": math.exp(min(nll, 700.0)),
            "accuracy": float(sums["correct"]) / denom, "tokens": tokens}


# =============================================================================================================
# 4. Evaluation
# =============================================================================================================


def evaluate_loss(params, eval_step, batches: Iterable[Mapping[str, np.ndarray]], n_devices: int = 1
                  ) -> dict[str, float]:
    """Loss, perplexity and token accuracy over evaluation batches (dicts src/tgt_in/tgt_out)."""
    total = {"loss": 0.0, "nll": 0.0, "tokens": 0.0, "correct": 0.0}
    for batch in batches:
        sums = jax.device_get(eval_step(params, shard_batch(batch, n_devices)))
        if n_devices > 1:
            sums = {k: v[0] for k, v in sums.items()}  # psummed: every device holds the total
        for k in total:
            total[k] += float(sums[k])
    return summarize(total)


def decoder_available() -> bool:
    """Whether `jax_transformer.decoding` (greedy / beam search) is installed in this tree."""
    import importlib.util

    return importlib.util.find_spec("jax_transformer.decoding") is not None


def translate_sentences(params, config: TransformerConfig, tokenizer, sentences: Sequence[str], *,
                        beam_size: int = 4, alpha: float = 0.6, **kwargs) -> list[str]:
    """Detokenized translations with `jax_transformer.decoding.translate` (beam search; beam_size=1 is greedy)."""
    from jax_transformer.decoding import translate

    return translate(params, config, tokenizer, list(sentences), beam_size=beam_size, alpha=alpha, **kwargs)


def score_translations(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Corpus BLEU and chrF with sacrebleu's defaults (13a tokenization, cased) on detokenized text."""
    import sacrebleu

    return {"bleu": sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score,
            "chrf": sacrebleu.corpus_chrf(list(hypotheses), [list(references)]).score}


def evaluate_translations(params, config: TransformerConfig, tokenizer, sources: Sequence[str],
                          references: Sequence[str], *, beam_size: int = 4, alpha: float = 0.6
                          ) -> tuple[dict[str, float], list[str]]:
    """Translates `sources` and scores them against `references`: ({"bleu", "chrf"}, hypotheses)."""
    hypotheses = translate_sentences(params, config, tokenizer, sources, beam_size=beam_size, alpha=alpha)
    return score_translations(hypotheses, references), hypotheses
