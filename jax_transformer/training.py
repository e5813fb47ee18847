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
import functools
import json
import math
import os
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
    # A copy: the train step donates the state's buffers, which must not be the caller's arrays.
    params = jax.tree_util.tree_map(lambda p: jnp.array(p, copy=True), params)
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
    return _compiled_train_step(config, opt, n_devices, dropout)


@functools.lru_cache(maxsize=16)  # one compiled step per (config, optimiser, devices, dropout), reused by later runs
def _compiled_train_step(config: TransformerConfig, opt: OptimConfig, n_devices: int, dropout: bool):
    tx = make_optimizer(config, opt)
    if n_devices == 1:
        fn = lambda state, batch: train_step(state, batch, config=config, tx=tx,  # noqa: E731
                                              label_smoothing=opt.label_smoothing, dropout=dropout)
        return jax.jit(fn, donate_argnums=0)
    fn = lambda state, batch: train_step(state, batch, config=config, tx=tx,  # noqa: E731
                                          label_smoothing=opt.label_smoothing, dropout=dropout, axis_name=AXIS)
    return jax.pmap(fn, axis_name=AXIS, donate_argnums=0)


@functools.lru_cache(maxsize=16)
def make_eval_step(config: TransformerConfig, label_smoothing: float):
    """Compiled evaluation on one device: (params, batch) -> loss sums, dropout off. Params are not donated."""
    return jax.jit(lambda params, batch: batch_loss_sums(params, batch, config, label_smoothing))


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

    devices = jax.local_devices()[:n_devices]
    replicated = flax.jax_utils.replicate(tree, devices=devices)
    # flax's replicate gives the arrays a different sharding than a pmap step returns, so the step's second call
    # would compile again (tens of seconds on CPU). One identity pmap gives them the step's own sharding.
    return jax.pmap(lambda x: x, axis_name=AXIS, devices=devices)(replicated)


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


def evaluate_loss(params, eval_step, batches: Iterable[Mapping[str, np.ndarray]]) -> dict[str, float]:
    """Loss, perplexity and token accuracy over evaluation batches (dicts src/tgt_in/tgt_out), on one device
    (under pmap training, pass the first replica's params)."""
    total = {"loss": 0.0, "nll": 0.0, "tokens": 0.0, "correct": 0.0}
    for batch in batches:
        sums = jax.device_get(eval_step(params, batch))
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


def spread_indices(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n): sample translations from across a (often sorted) corpus."""
    return sorted(set(np.linspace(0, n - 1, num=min(k, n), dtype=int).tolist())) if n and k > 0 else []


def score_translations(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Corpus BLEU and chrF with sacrebleu's defaults (13a tokenization, cased) on detokenized text."""
    import sacrebleu

    return {"bleu": sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score,
            "chrf": sacrebleu.corpus_chrf(list(hypotheses), [list(references)]).score}


def evaluate_translations(params, config: TransformerConfig, tokenizer, sources: Sequence[str],
                          references: Sequence[str], *, beam_size: int = 4, alpha: float = 0.6,
                          progress: bool = True) -> tuple[dict[str, float], list[str]]:
    """Translates `sources` and scores them against `references`: ({"bleu", "chrf"}, hypotheses)."""
    hypotheses = translate_sentences(params, config, tokenizer, sources, beam_size=beam_size, alpha=alpha,
                                     progress=progress)
    return score_translations(hypotheses, references), hypotheses


# =============================================================================================================
# 5. The training loop
# =============================================================================================================


@dataclasses.dataclass
class ValidationSet:
    """Validation data in the two forms evaluation needs: id batches for the loss, text for BLEU / chrF."""

    batches: list[dict[str, np.ndarray]]
    sources: list[str]
    references: list[str]

    @classmethod
    def from_encoded(cls, encoded, corpus, max_tokens: int) -> "ValidationSet":
        """`encoded` = encode_corpus(corpus, ...); pairs skipped as too long are left out of both forms."""
        from jax_transformer.data import eval_batches

        batches = [batch for batch, _ in eval_batches(encoded, max_tokens)]
        return cls(batches, [corpus.sources[i] for i in encoded.corpus_index],
                   [corpus.targets[i] for i in encoded.corpus_index])


@dataclasses.dataclass
class LoopConfig:
    """When the loop evaluates, saves and stops."""

    steps: int  # stop after this many updates in total (a resumed run counts the steps before the resume)
    eval_every: int = 1000  # validate (loss; BLEU/chrF when a decoder exists) every this many steps
    save_every: int = 1000  # checkpoint every this many steps (and at evaluations and at the end)
    max_minutes: float | None = None  # stop after this much wall time since `start_time`
    eval_beam_size: int = 1  # beam size of the BLEU evaluations during training (1: greedy, fast)
    final_beam_size: int = 4  # beam size of the final evaluation
    alpha: float = 0.6  # length penalty of beam search (GNMT), as in paper section 6.1
    eval_sentences: int | None = None  # BLEU during training on the first this many validation sentences
    # (None: all; 0: no BLEU at all). The final evaluation always uses them all.
    samples: int = 5  # sample translations printed at each evaluation
    progress: bool = True  # tqdm progress bar


class MetricsLog:
    """Appends one JSON object per line to `<run>/metrics.jsonl`: {"kind": "train" | "eval", "step": ...}."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def truncate_metrics(path: str | os.PathLike, after_step: int) -> None:
    """Drops records of steps > after_step: a resumed run rewrites the steps the interrupted one did after its
    last checkpoint, and the curve should show each step once."""
    path = Path(path)
    if not path.exists():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= after_step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def plot_metrics(metrics_path: str | os.PathLike, png_path: str | os.PathLike) -> Path | None:
    """Loss curve (training loss, smoothed, and validation loss) and BLEU/chrF per evaluation, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in Path(metrics_path).read_text(encoding="utf-8").splitlines() if line]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    if not train:
        return None
    fig, (ax_loss, ax_bleu) = plt.subplots(1, 2, figsize=(11, 4))
    steps = np.array([r["step"] for r in train])
    loss = np.array([r["loss"] for r in train])
    ax_loss.plot(steps, loss, color="tab:blue", alpha=0.25, linewidth=0.8)
    window = max(1, len(loss) // 50)  # a moving average over ~2% of the run
    smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
    ax_loss.plot(steps[window - 1:], smooth, color="tab:blue", label="train (label-smoothed)")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["valid_loss"] for r in evals], "o-", color="tab:orange",
                     label="validation (label-smoothed)")
    ax_loss.set(xlabel="step", ylabel="loss per target token", title="Loss")
    ax_loss.legend()
    scored = [r for r in evals if "bleu" in r]
    if scored:
        ax_bleu.plot([r["step"] for r in scored], [r["bleu"] for r in scored], "o-", label="BLEU")
        ax_bleu.plot([r["step"] for r in scored], [r["chrf"] for r in scored], "s-", label="chrF")
        ax_bleu.legend()
    ax_bleu.set(xlabel="step", ylabel="score", title="Validation BLEU / chrF (sacrebleu)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return Path(png_path)


class _StopSignals:
    """Turns SIGINT / SIGTERM into a flag the loop checks after each step, so it can save and exit cleanly.
    A second signal of the same kind restores the default behaviour (a second Ctrl-C kills at once)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous = {}

    def __enter__(self) -> "_StopSignals":
        import threading

        if threading.current_thread() is threading.main_thread():  # signal handlers only work there
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
        self.received = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclasses.dataclass
class RunResult:
    """How a `Trainer.run` ended."""

    step: int
    stopped_by: str  # "steps", "time", "SIGINT", "SIGTERM"
    final_eval: dict[str, float] | None
    samples: list[tuple[str, str, str]]  # (source, reference, hypothesis)
    curve: Path | None


class Trainer:
    """Runs training steps from a BatchStream, evaluates, checkpoints and logs, until the step budget, the wall
    time budget or a stop signal. `state` may be fresh or restored; `stream` must be positioned to match it."""

    def __init__(self, *, config: TransformerConfig, optim: OptimConfig, tokenizer, stream, state: TrainState,
                 loop: LoopConfig, run_dir: str | os.PathLike, checkpoints, valid: ValidationSet | None = None,
                 run_settings: Mapping[str, Any] | None = None, n_devices: int = 1, start_time: float | None = None,
                 print_fn: Callable[[str], None] = print) -> None:
        self.config, self.optim, self.tokenizer, self.stream = config, optim, tokenizer, stream
        self.loop, self.valid, self.checkpoints = loop, valid, checkpoints
        self.run_dir = Path(run_dir)
        self.run_settings = dict(run_settings or {})
        self.n_devices = n_devices
        self.start_time = time.time() if start_time is None else start_time
        self.print = print_fn
        self.step = int(jax.device_get(state.step))
        self.state = replicate(state, n_devices)
        self.train_step = make_train_step(config, optim, n_devices=n_devices)
        self.eval_step = make_eval_step(config, optim.label_smoothing)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        # A resumed state is already on disk under its step; orbax cannot save a step twice.
        self.last_saved_step: int | None = self.step if self.step in checkpoints.steps() else None

    # --- pieces ----------------------------------------------------------------------------------------------
    def host_params(self):
        return unreplicate(self.state, self.n_devices).params

    def save(self, metrics: Mapping[str, float] | None = None) -> None:
        if self.last_saved_step == self.step:
            return
        self.checkpoints.save(self.step, unreplicate(self.state, self.n_devices), config=self.config,
                              optim=self.optim.to_dict(), tokenizer=self.tokenizer, data_state=self.stream.state(),
                              run=self.run_settings, metrics=metrics)
        self.last_saved_step = self.step

    def evaluate(self, *, beam_size: int, final: bool = False) -> tuple[dict[str, float], list]:
        """Validation loss/perplexity/accuracy, and BLEU/chrF when `jax_transformer.decoding` exists."""
        params = self.host_params()
        result = {f"valid_{k}": v for k, v in evaluate_loss(params, self.eval_step, self.valid.batches).items()}
        samples = []
        # The final evaluation scores every validation sentence; evaluations during training the first
        # `eval_sentences` (None: all); 0 turns BLEU off in both.
        limit = self.loop.eval_sentences
        n = len(self.valid.sources)
        if limit == 0 or (limit is not None and not final):
            n = min(n, limit)
        if n > 0 and decoder_available():
            sources, references = self.valid.sources[:n], self.valid.references[:n]
            try:
                scores, hypotheses = evaluate_translations(params, self.config, self.tokenizer, sources,
                                                           references, beam_size=beam_size, alpha=self.loop.alpha,
                                                           progress=self.loop.progress)
            except Exception as e:  # a decoding failure must not end a long training run: warn, go on
                self.print(f"warning: step {self.step}: BLEU evaluation failed ({type(e).__name__}: {e}); "
                           f"continuing with the validation loss only")
                result["decode_error"] = f"{type(e).__name__}: {e}"
            else:
                result.update(scores, beam_size=beam_size, sentences=len(sources))
                samples = [(sources[i], references[i], hypotheses[i])
                           for i in spread_indices(len(sources), self.loop.samples)]
        # The best checkpoint is chosen by BLEU when there is one, else by (minus) the validation loss.
        result["score"] = result.get("bleu", -result["valid_loss"])
        self.metrics.write({"kind": "eval", "step": self.step, "final": final,
                            "elapsed_s": round(time.time() - self.start_time, 1), **result})
        return result, samples

    def report(self, result: Mapping[str, float], samples) -> None:
        line = (f"step {self.step}: valid loss {result['valid_loss']:.3f}, ppl {result['valid_ppl']:.2f}, "
                f"token accuracy {100 * result['valid_accuracy']:.1f}%")
        if "bleu" in result:
            line += (f", BLEU {result['bleu']:.2f}, chrF {result['chrf']:.2f} "
                     f"(sacrebleu, {result['sentences']} sentences, beam {result['beam_size']})")
        elif "decode_error" in result:
            line += " (no BLEU: decoding failed)"
        elif self.loop.eval_sentences == 0:
            line += " (BLEU off: --eval-sentences 0)"
        else:
            line += " (no BLEU: jax_transformer.decoding is not available)"
        self.print(line)
        for source, reference, hypothesis in samples:
            self.print(f"  source:    {source}\n  reference: {reference}\n  model:     {hypothesis}")

    def _stop_reason(self, signals: _StopSignals) -> str | None:
        if signals.received is not None:
            return signal.Signals(signals.received).name
        if self.step >= self.loop.steps:
            return "steps"
        if self.loop.max_minutes is not None and time.time() - self.start_time >= 60.0 * self.loop.max_minutes:
            return "time"
        return None

    def _one_step(self, bar) -> None:
        """One update on the next batch; logs it; raises TrainingError on a non-finite loss."""
        lr = float(noam_rate(self.step + 1, self.config.d_model, self.optim.warmup_steps, self.optim.lr_scale))
        batch = shard_batch(next(self.stream), self.n_devices)
        self.state, sums = self.train_step(self.state, batch)
        sums = jax.device_get(sums)
        if self.n_devices > 1:
            sums = {k: v[0] for k, v in sums.items()}  # psummed: every device holds the total
        stats = summarize(sums)
        if not math.isfinite(stats["loss"]):
            # The update just applied came from a non-finite gradient, so the state is ruined. Stop without
            # saving it: the last checkpoint on disk stays the last good one.
            self.metrics.write({"kind": "train", "step": self.step + 1, "lr": lr, "loss": stats["loss"],
                                "error": "non-finite loss"})
            raise TrainingError(
                f"step {self.step + 1}: the training loss is {stats['loss']} (not finite); stopped without "
                f"saving. The last good checkpoint is step {self.checkpoints.latest_step()} in "
                f"{self.checkpoints.directory}. Try a lower --lr-scale, a longer --warmup or --clip-norm.")
        self.step += 1
        tokens, start = self._window
        tokens, now = tokens + stats["tokens"], time.time()
        tokens_per_s = tokens / max(now - start, 1e-9)
        self._window = (0.0, now) if now - start > 10.0 else (tokens, start)  # a ~10 second window
        self.metrics.write({"kind": "train", "step": self.step, "lr": lr, "tokens_per_s": round(tokens_per_s, 1),
                            "elapsed_s": round(now - self.start_time, 1), **stats})
        bar.update(1)
        bar.set_postfix(loss=f"{stats['loss']:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:.0f}", refresh=False)

    # --- the loop --------------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        from tqdm.auto import tqdm

        loop = self.loop
        bar = tqdm(total=loop.steps, initial=self.step, unit="step", disable=not loop.progress,
                   dynamic_ncols=True, mininterval=1.0)
        self._window = (0.0, time.time())  # tokens and start time of the tokens/s window
        try:
            with _StopSignals() as signals:
                while (stopped_by := self._stop_reason(signals)) is None:
                    self._one_step(bar)
                    if self._stop_reason(signals) is not None:
                        continue  # the final evaluation and save below handle this step
                    if self.valid is not None and self.step % loop.eval_every == 0:
                        bar.clear()
                        result, samples = self.evaluate(beam_size=loop.eval_beam_size)
                        self.report(result, samples[:2])
                        self.save(metrics={"score": result["score"]})
                    elif self.step % loop.save_every == 0:
                        self.save()
            bar.close()
            if stopped_by.startswith("SIG"):  # asked to stop: save quickly, no final evaluation
                self.save()
                self.print(f"stopped by {stopped_by} at step {self.step}; checkpoint saved in "
                           f"{self.checkpoints.directory} (resume with --resume {self.run_dir})")
                return RunResult(self.step, stopped_by, None, [], self._plot())
            if stopped_by == "time":
                self.print(f"stopping at step {self.step}: --max-minutes {loop.max_minutes} reached")
            final, samples = None, []
            if self.valid is not None:
                final, samples = self.evaluate(beam_size=loop.final_beam_size, final=True)
                self.report(final, samples)
                self.save(metrics={"score": final["score"]})
            else:
                self.save()
            return RunResult(self.step, stopped_by, final, samples, self._plot())
        finally:
            bar.close()
            self.checkpoints.wait()  # never leave with a save half-written
            self.metrics.close()

    def _plot(self) -> Path | None:
        try:
            return plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "loss_curve.png")
        except Exception as e:  # a plotting problem must not lose a finished run
            self.print(f"warning: could not draw the loss curve: {e}")
            return None


# =============================================================================================================
# 6. Setting up a run: data specs and corpus fingerprints
# =============================================================================================================


def data_spec(*, src=None, tgt=None, tsv=None, default=None, what: str = "training") -> dict[str, str] | None:
    """A JSON-able description of where a corpus comes from (stored in checkpoints so a resume re-reads it):
    {"kind": "parallel", "src", "tgt"}, {"kind": "tsv", "tsv"}, {"kind": "default", "split"}, or None."""
    from jax_transformer.data import DataError

    if tsv is not None and (src is not None or tgt is not None):
        raise DataError(f"{what} data: give either a TSV file or a source and a target file, not both")
    if tsv is not None:
        return {"kind": "tsv", "tsv": str(Path(tsv).absolute())}
    if (src is None) != (tgt is None):
        given, missing = ("source", "target") if tgt is None else ("target", "source")
        raise DataError(f"{what} data: a {given} file was given without its {missing} file")
    if src is not None:
        return {"kind": "parallel", "src": str(Path(src).absolute()), "tgt": str(Path(tgt).absolute())}
    return None if default is None else {"kind": "default", "split": default}


def load_corpus(spec: Mapping[str, str], *, on_empty: str = "skip"):
    """Reads the corpus a `data_spec` describes (DataError naming the file and line for bad input)."""
    from jax_transformer import data

    if spec["kind"] == "parallel":
        return data.read_parallel(spec["src"], spec["tgt"], on_empty=on_empty)
    if spec["kind"] == "tsv":
        return data.read_tsv(spec["tsv"], on_empty=on_empty)
    from jax_transformer import default_task

    return default_task.default_pairs(spec["split"])


def corpus_fingerprint(corpus) -> str:
    """A hash of the pairs' text: a resumed run checks it sees the same training data."""
    import hashlib

    digest = hashlib.sha256()
    for source, target in zip(corpus.sources, corpus.targets):
        digest.update(source.encode("utf-8") + b"\t" + target.encode("utf-8") + b"\n")
    return digest.hexdigest()[:16]
