"""The training run loop: batches in, steps, evaluations, checkpoints, metrics and a progress bar, until a stop.

`Trainer.run` takes batches from a `BatchStream`, applies the compiled step of `jax_transformer.training`, and
every `eval_every` steps measures the validation loss and BLEU (`jax_transformer.evaluation`), keeping the best
checkpoint by `best_metric`; every `save_every` steps it saves one (`jax_transformer.checkpoint`). It stops at the
step budget, the wall-time budget, when the validation score has not improved for `patience` evaluations
(`EarlyStopping`, fairseq's --patience), at a SIGINT/SIGTERM (after saving) or at a non-finite loss (without
saving, so the last good checkpoint stays the last one). Each step and evaluation is a line of
`<run>/metrics.jsonl`, drawn as `<run>/loss_curve.png` at the end.

Which checkpoint is "best": the one with the highest selection score, the score the evaluations *during*
training compute (`eval_beam_size`, the first `eval_sentences` sentences; or minus the validation loss). The final
evaluation (`beam_size`, every sentence) is a report; the last checkpoint competes with the score an evaluation
during training would give it, so that a beam-4 BLEU on all sentences never competes with greedy ones.

Faults: every batch is checked on the host before it goes to the compiled step (`checks.check_batch`: ids in
the vocabulary, lengths within max_len, packing consistent), and a failed save stops the run with a
CheckpointError naming the newest intact checkpoint.

On several devices or processes (`jax_transformer.distributed`) the loop is the same in every process: each
takes the same global batches and feeds its own rows, evaluates the same replicated parameters (so every process
computes the numbers one process would report) and takes part in every checkpoint save (orbax writes them
together). Process 0 alone writes metrics, the plot and the progress bar and prints; the reasons to stop are
agreed at each step boundary (`agree_on_stop`), so all processes leave the loop at the same step.

Setting up a run (data, tokenizer, config, initial or restored state) is `jax_transformer.run`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jax_transformer.checkpoint import CheckpointError
from jax_transformer.checks import TokenError, check_batch
from jax_transformer.config import ConfigError, OptimConfig, TransformerConfig, setting, settings_from_dict
from jax_transformer.data import Corpus, DataError, EncodedCorpus, eval_batches
from jax_transformer.distributed import DataParallel, agree_on_stop, is_primary
from jax_transformer.evaluation import evaluate_translations, spread_indices
from jax_transformer.training import (
    TrainState,
    evaluate_loss,
    make_eval_step,
    noam_rate,
    state_for_saving,
    summarize,
)
from jax_transformer.visualize import plot_metrics

BEST_METRICS = ("bleu", "loss")


class TrainingError(RuntimeError):
    """Training cannot go on (for example the loss became NaN); the message says at which step and why."""


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """When the loop evaluates, saves and stops, and what it prints."""

    steps: int = setting(20000, "total optimiser steps (a resumed run counts the steps before the resume)")
    max_minutes: float | None = setting(
        None, "stop after this many minutes of wall time since the command started, then evaluate and save"
    )
    eval_every: int = setting(2000, "validate (loss, BLEU, chrF) every this many steps and keep the best checkpoint")
    save_every: int = setting(1000, "checkpoint every this many steps (and at evaluations and at the end)")
    keep: int = setting(3, "keep the last this many checkpoints, plus the best")
    eval_beam_size: int = setting(1, "beam width of the BLEU evaluations during training (1: greedy, fast)")
    eval_sentences: int | None = setting(
        None,
        "BLEU/chrF of the evaluations during training on the first this "
        "many validation sentences; the final evaluation uses all (default: "
        "all; 0: no BLEU at all, loss only)",
    )
    beam_size: int = setting(4, "beam width of the final evaluation; 1 is greedy search")
    alpha: float = setting(0.6, "length penalty exponent of beam search, ((5+len)/6)^alpha (GNMT)")
    samples: int = setting(5, "sample translations printed by the final evaluation")
    progress: bool = setting(True, "show a progress bar")
    best_metric: str = setting(
        "bleu",
        "what 'better' means for the best checkpoint (the one evaluate/translate/export use) and for --patience: "
        "bleu (validation BLEU of the evaluations during training; the validation loss when --eval-sentences 0 "
        "turns BLEU off) or loss (validation loss, lower is better)",
        choices=BEST_METRICS,
    )
    patience: int | None = setting(
        None,
        "stop when the validation score (--best-metric) has not improved for this many evaluations in a row, "
        "as fairseq's --patience; none: never stop early",
    )

    def __post_init__(self) -> None:
        for name in ("eval_every", "save_every", "keep", "eval_beam_size", "beam_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"loop field {name!r} must be an int >= 1, got {value!r}")
        for name in ("steps", "samples", "eval_sentences", "patience"):  # steps 0: save the initial state and stop
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(f"loop field {name!r} must be an int >= 0, got {value!r}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ConfigError(f"loop field 'max_minutes' must be > 0, got {self.max_minutes}")
        if not self.alpha >= 0:
            raise ConfigError(f"loop field 'alpha' must be >= 0, got {self.alpha}")
        if self.patience == 0:
            raise ConfigError("loop field 'patience' must be >= 1 (or unset: never stop early), got 0")
        if self.best_metric not in BEST_METRICS:
            raise ConfigError(f"loop field 'best_metric' must be one of {BEST_METRICS}, got {self.best_metric!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "loop settings") -> LoopConfig:
        return settings_from_dict(cls, values, source)


@dataclasses.dataclass
class ValidationSet:
    """Validation data in the two forms evaluation needs: id batches for the loss, text for BLEU / chrF."""

    batches: list[dict[str, np.ndarray]]
    sources: list[str]
    references: list[str]

    @classmethod
    def from_encoded(cls, encoded: EncodedCorpus, corpus: Corpus, max_tokens: int) -> ValidationSet:
        """`encoded` = encode_corpus(corpus, ...); pairs skipped as too long are left out of both forms."""
        batches = [batch for batch, _ in eval_batches(encoded, max_tokens)]
        return cls(
            batches,
            [corpus.sources[i] for i in encoded.corpus_index],
            [corpus.targets[i] for i in encoded.corpus_index],
        )


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


class DiscardedMetrics:
    """What processes other than process 0 log to: nothing (process 0 writes metrics.jsonl)."""

    def write(self, record: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def truncate_metrics(path: str | os.PathLike, after_step: int) -> None:
    """Drops records of steps > after_step: a resumed run rewrites the steps the interrupted one did after its
    last checkpoint, and the curve should show each step once."""
    path = Path(path)
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip() and json.loads(line).get("step", 0) <= after_step
    ]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


class StopSignals:
    """Turns SIGINT / SIGTERM into a flag the loop checks after each step, so it can save and exit cleanly.
    A second signal of the same kind restores the default behaviour (a second Ctrl-C kills at once)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous = {}

    def __enter__(self) -> StopSignals:
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
class EarlyStopping:
    """fairseq's --patience: the best selection score so far and how many evaluations in a row have not beaten it
    (strictly). Saved in every checkpoint (`loop_state`), so that a resumed run counts on from where the
    interrupted one was and stops at the same step as an uninterrupted run."""

    best_score: float | None = None  # higher is better (minus the loss for best_metric "loss")
    best_step: int | None = None
    bad_evals: int = 0  # evaluations since best_step that did not improve on it
    last_eval_step: int | None = None  # the step of the last counted evaluation
    last_score: float | None = None  # its score (None: BLEU was asked for and decoding failed)

    def update(self, step: int, score: float | None) -> bool:
        """Counts the evaluation of `step`; True when it improved on the best."""
        self.last_eval_step, self.last_score = step, score
        if score is not None and (self.best_score is None or score > self.best_score):
            self.best_score, self.best_step, self.bad_evals = score, step, 0
            return True
        self.bad_evals += 1
        return False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> EarlyStopping:
        """From a checkpoint's `loop_state` (None: a checkpoint from before early stopping: start afresh)."""
        return cls(**(values or {}).get("early_stopping", {}))


@dataclasses.dataclass
class RunResult:
    """How a `Trainer.run` ended."""

    step: int
    stopped_by: str  # "steps", "time", "patience", "SIGINT", "SIGTERM"
    final_eval: dict[str, float] | None
    samples: list[tuple[str, str, str]]  # (source, reference, hypothesis)
    curve: Path | None
    checkpoint_dir: Path | None = None  # where the checkpoints are
    best_step: int | None = None  # the checkpoint evaluate/translate/export use by default
    best_metric: str | None = None  # what chose it: "bleu" or "loss" (None: no validation data, the last step)


class Trainer:
    """Runs training steps from a BatchStream, evaluates, checkpoints and logs, until the step budget, the wall
    time budget or a stop signal. `state` may be fresh or restored; `stream` must be positioned to match it."""

    def __init__(
        self,
        *,
        config: TransformerConfig,
        optim: OptimConfig,
        tokenizer,
        stream,
        state: TrainState,
        loop: LoopConfig,
        run_dir: str | os.PathLike,
        checkpoints,
        valid: ValidationSet | None = None,
        run_settings: Mapping[str, Any] | None = None,
        parallel: DataParallel | None = None,
        start_time: float | None = None,
        print_fn: Callable[[str], None] = print,
        loop_state: Mapping[str, Any] | None = None,
    ) -> None:
        """`loop_state`: what a restored checkpoint's `loop_state` holds (early stopping's counter and best)."""
        self.config, self.optim, self.tokenizer, self.stream = config, optim, tokenizer, stream
        self.loop, self.valid, self.checkpoints = loop, valid, checkpoints
        self.run_dir = Path(run_dir)
        self.run_settings = dict(run_settings or {})
        self.parallel = DataParallel() if parallel is None else parallel
        self.start_time = time.time() if start_time is None else start_time
        self.primary = is_primary()  # process 0 (or the only process): writes files, prints
        self.print = print_fn if self.primary else lambda text: None
        self.step = int(jax.device_get(state.step))
        self.state = self.parallel.place_state(state)
        self.train_step = self.parallel.make_step(config, optim)
        self.eval_step = make_eval_step(config, optim.label_smoothing)
        if valid is not None:  # checked once here; training batches are checked as they come (`_one_step`)
            for i, batch in enumerate(valid.batches):
                self._check(batch, f"validation batch {i}")
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl") if self.primary else DiscardedMetrics()
        self._decided: tuple[int, str | None] | None = None  # (step, agreed stop reason) in multi-process runs
        self.early = EarlyStopping.from_dict(loop_state)
        # A resumed state is already on disk under its step; orbax cannot save a step twice.
        self.last_saved_step: int | None = self.step if self.step in checkpoints.steps() else None

    # --- pieces ----------------------------------------------------------------------------------------------
    def host_params(self):
        return self.parallel.local(self.state).params

    def _check(self, batch, where: str):
        """The batch boundary: a bad batch is a DataError before it reaches the compiled step (and its donated
        state), never NaN logits or a silently wrong embedding row."""
        try:
            check_batch(batch, self.config, where)
        except TokenError as e:
            raise DataError(f"{e} (the batches do not fit the model; is the tokenizer the model's?)") from None
        return batch

    def save(self, metrics: Mapping[str, float] | None = None) -> None:
        if self.last_saved_step == self.step:
            return
        state = state_for_saving(self.parallel.local(self.state))
        try:
            self.checkpoints.save(
                self.step,
                state,
                config=self.config,
                optim=self.optim.to_dict(),
                tokenizer=self.tokenizer,
                data_state=self.stream.state(),
                run=self.run_settings,
                metrics=metrics,
                loop_state={"early_stopping": self.early.to_dict()},
            )
        except CheckpointError as e:
            raise self._save_failed(e) from None
        self.last_saved_step = self.step

    def _save_failed(self, error: CheckpointError) -> CheckpointError:
        return CheckpointError(f"training stopped at step {self.step}: {error}. Resume with --resume {self.run_dir}")

    def selection_metric(self) -> str:
        """What the best checkpoint and early stopping compare: "bleu", or "loss" (asked for, or BLEU off)."""
        bleu_on = self.loop.eval_sentences != 0 and len(self.valid.sources) > 0
        return "bleu" if self.loop.best_metric == "bleu" and bleu_on else "loss"

    def evaluate(self, *, final: bool = False, counted: bool = False) -> tuple[dict[str, Any], list]:
        """Validation loss/perplexity/accuracy, and BLEU/chrF of the translations (see `eval_sentences`), written
        to metrics.jsonl. During training (final False) with the training-time decoding (`eval_beam_size`, the
        first `eval_sentences` sentences) and a selection score, "score" (higher is better; None when BLEU was
        asked for and decoding failed), which early stopping counts when `counted`; the final evaluation with
        `beam_size` on every sentence, as a report."""
        beam_size = self.loop.beam_size if final else self.loop.eval_beam_size
        params = self.host_params()
        result = {f"valid_{k}": v for k, v in evaluate_loss(params, self.eval_step, self.valid.batches).items()}
        samples = []
        # The final evaluation scores every validation sentence; evaluations during training the first
        # `eval_sentences` (None: all); 0 turns BLEU off in both.
        limit = self.loop.eval_sentences
        n = len(self.valid.sources)
        if limit == 0 or (limit is not None and not final):
            n = min(n, limit)
        if n > 0:
            sources, references = self.valid.sources[:n], self.valid.references[:n]
            try:
                scores, hypotheses = evaluate_translations(
                    params,
                    self.config,
                    self.tokenizer,
                    sources,
                    references,
                    beam_size=beam_size,
                    alpha=self.loop.alpha,
                    progress=self.loop.progress,
                )
            except Exception as e:  # a decoding failure must not end a long training run: warn, go on
                self.print(
                    f"warning: step {self.step}: BLEU evaluation failed ({type(e).__name__}: {e}); "
                    f"continuing with the validation loss only"
                )
                result["decode_error"] = f"{type(e).__name__}: {e}"
            else:
                result.update(scores, beam_size=beam_size, sentences=len(sources))
                samples = [
                    (sources[i], references[i], hypotheses[i]) for i in spread_indices(len(sources), self.loop.samples)
                ]
        if not final:
            metric = self.selection_metric()
            result["score"] = -result["valid_loss"] if metric == "loss" else result.get("bleu")
            result["score_metric"] = metric
            if counted:
                self.early.update(self.step, result["score"])
                result.update(best_step=self.early.best_step, bad_evals=self.early.bad_evals)
        self.metrics.write(
            {
                "kind": "eval",
                "step": self.step,
                "final": final,
                "elapsed_s": round(time.time() - self.start_time, 1),
                **result,
            }
        )
        return result, samples

    def report(self, result: Mapping[str, Any], samples, *, final: bool = False) -> None:
        line = (
            f"step {self.step}: valid loss {result['valid_loss']:.3f}, ppl {result['valid_ppl']:.2f}, "
            f"token accuracy {100 * result['valid_accuracy']:.1f}%"
        )
        if "bleu" in result:
            line += (
                f", BLEU {result['bleu']:.2f}, chrF {result['chrf']:.2f} "
                f"(sacrebleu, {result['sentences']} sentences, beam {result['beam_size']})"
            )
        elif "decode_error" in result:
            line += " (no BLEU: decoding failed)"
        else:
            line += " (BLEU off: --eval-sentences 0)"
        self.print(line)
        if final and "bleu" in result:  # how the figures were computed, for the record
            self.print(
                f"  sacreBLEU {result['bleu_signature']}; chrF {result['chrf_signature']}; lowercased BLEU "
                f"{result['bleu_lc']:.2f} ({result['bleu_lc_signature']})"
            )
        for source, reference, hypothesis in samples:
            self.print(f"  source:    {source}\n  reference: {reference}\n  model:     {hypothesis}")

    def _describe_best(self) -> str:
        early = self.early
        if early.best_score is None:
            return "no score yet"
        best = f"BLEU {early.best_score:.2f}" if self.selection_metric() == "bleu" else f"loss {-early.best_score:.3f}"
        return f"best {best} at step {early.best_step}"

    def _validate(self) -> None:
        """The evaluation every `eval_every` steps: scored, counted by early stopping, saved with its score."""
        result, samples = self.evaluate(counted=True)
        self.report(result, samples[:2])
        if self.loop.patience is not None:
            self.print(
                f"  early stopping: {self.early.bad_evals} of {self.loop.patience} evaluations without improvement "
                f"({self._describe_best()})"
            )
        self.save(metrics=None if result["score"] is None else {"score": result["score"]})

    def _final_evaluation(self) -> tuple[dict[str, Any], list, float | None]:
        """The final report (beam_size, every sentence) and the selection score of the last step: the score an
        evaluation during training gives it, so that it competes fairly for "best" (see the module docstring).
        An evaluation made only for that score is logged but not counted by early stopping: an uninterrupted
        run would not have made it."""
        final, samples = self.evaluate(final=True)
        if self.early.last_eval_step == self.step:  # evaluated at this step already (an eval_every step)
            return final, samples, self.early.last_score
        if self.selection_metric() == "loss":  # the loss does not depend on the decoding settings
            return final, samples, -final["valid_loss"]
        n = len(self.valid.sources)
        if self.loop.eval_beam_size == self.loop.beam_size and (self.loop.eval_sentences or n) >= n:
            return final, samples, final.get("bleu")  # the training-time evaluation would decode the same
        selection, _ = self.evaluate()
        return final, samples, selection["score"]

    def _stop_reason(self, signals: StopSignals) -> str | None:
        """Why to stop now, or None: this process's reason (`local_stop_reason`), agreed with the other processes
        once per step in a multi-process run (process 0's reason first, see `distributed.agree_on_stop`)."""
        if jax.process_count() == 1:
            return self.local_stop_reason(signals)
        if self._decided is None or self._decided[0] != self.step:
            self._decided = (self.step, agree_on_stop(self.local_stop_reason(signals)))
        return self._decided[1]

    def local_stop_reason(self, signals: StopSignals) -> str | None:
        """The one place that collects this process's reasons to stop (a signal, the step budget, the time
        budget); a new reason belongs here, and reaches every process through `_stop_reason`."""
        if signals.received is not None:
            return signal.Signals(signals.received).name
        if self.loop.patience is not None and self.early.bad_evals >= self.loop.patience:
            return "patience"
        if self.step >= self.loop.steps:
            return "steps"
        if self.loop.max_minutes is not None and time.time() - self.start_time >= 60.0 * self.loop.max_minutes:
            return "time"
        return None

    def _eval_due(self) -> bool:
        """This step is an evaluation step (a multiple of eval_every) not yet evaluated."""
        return (
            self.valid is not None
            and self.step > 0
            and self.step % self.loop.eval_every == 0
            and self.early.last_eval_step != self.step
        )

    def _one_step(self, bar) -> None:
        """One update on the next batch; logs it; raises TrainingError on a non-finite loss."""
        lr = float(noam_rate(self.step + 1, self.config.d_model, self.optim.warmup_steps, self.optim.lr_scale))
        batch = self.parallel.place_batch(self._check(next(self.stream), f"training batch {self.step + 1}"))
        self.state, sums = self.train_step(self.state, batch)
        sums = jax.device_get(self.parallel.local(sums))  # summed over devices: every device holds the total
        stats = summarize(sums)
        if not math.isfinite(stats["loss"]):
            # The update just applied came from a non-finite gradient, so the state is ruined. Stop without
            # saving it: the last checkpoint on disk stays the last good one.
            self.metrics.write(
                {"kind": "train", "step": self.step + 1, "lr": lr, "loss": stats["loss"], "error": "non-finite loss"}
            )
            raise TrainingError(
                f"step {self.step + 1}: the training loss is {stats['loss']} (not finite); stopped without "
                f"saving. The last good checkpoint is step {self.checkpoints.latest_step()} in "
                f"{self.checkpoints.directory}. Try a lower --lr-scale, a longer --warmup-steps or --clip-norm."
            )
        self.step += 1
        tokens, start = self._window
        tokens, now = tokens + stats["tokens"], time.time()
        tokens_per_s = tokens / max(now - start, 1e-9)
        self._window = (0.0, now) if now - start > 10.0 else (tokens, start)  # a ~10 second window
        self.metrics.write(
            {
                "kind": "train",
                "step": self.step,
                "lr": lr,
                "tokens_per_s": round(tokens_per_s, 1),
                "elapsed_s": round(now - self.start_time, 1),
                **stats,
            }
        )
        bar.update(1)
        bar.set_postfix(loss=f"{stats['loss']:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:.0f}", refresh=False)

    # --- the loop --------------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        from tqdm.auto import tqdm

        loop = self.loop
        bar = tqdm(
            total=loop.steps,
            initial=self.step,
            unit="step",
            disable=not (loop.progress and self.primary),
            dynamic_ncols=True,
            mininterval=1.0,
        )
        self._window = (0.0, time.time())  # tokens and start time of the tokens/s window
        try:
            with StopSignals() as signals:
                if self._eval_due():  # resumed from a step whose evaluation a signal pre-empted: do it now
                    # (early stopping counts it as the uninterrupted run did; that step's checkpoint is already on
                    # disk without a score, so it cannot become the best one)
                    self._validate()
                stopped_by = self._stop_reason(signals)
                while stopped_by is None:
                    self._one_step(bar)
                    # An evaluation step is evaluated (and counted by early stopping) however the run ends after
                    # it, except at a signal, which should stop quickly; the resumed run makes up for it. The
                    # reason is the one all processes agreed on, so they evaluate and save together.
                    stopped_by = self._stop_reason(signals)
                    if not (stopped_by or "").startswith("SIG") and self._eval_due():
                        bar.clear()
                        self._validate()
                        self._decided = None  # early stopping may have a reason now: ask again
                        stopped_by = self._stop_reason(signals)
                    if stopped_by is None and self.step % loop.save_every == 0:
                        self.save()  # (at the last step the final save below does it)
            bar.close()
            if stopped_by.startswith("SIG"):  # asked to stop: save quickly, no final evaluation
                self.save()
                self.print(
                    f"stopped by {stopped_by} at step {self.step}; checkpoint saved in "
                    f"{self.checkpoints.directory} (resume with --resume {self.run_dir})"
                )
                return self._result(stopped_by, None, [])
            if stopped_by == "time":
                self.print(f"stopping at step {self.step}: --max-minutes {loop.max_minutes} reached")
            elif stopped_by == "patience":
                self.print(
                    f"stopping at step {self.step}: validation {self.selection_metric()} has not improved for "
                    f"{loop.patience} evaluations ({self._describe_best()})"
                )
            final, samples = None, []
            if self.valid is not None:
                final, samples, score = self._final_evaluation()
                self.report(final, samples, final=True)
                self.save(metrics=None if score is None else {"score": score})
            else:
                self.save()
            return self._result(stopped_by, final, samples)
        finally:
            bar.close()
            try:
                self.checkpoints.wait()  # never leave with a save half-written
            except CheckpointError as e:
                raise self._save_failed(e) from None
            finally:
                self.metrics.close()

    def _result(self, stopped_by: str, final, samples) -> RunResult:
        self.checkpoints.wait()  # the best step is known once every save is on disk
        return RunResult(
            self.step,
            stopped_by,
            final,
            samples,
            self._plot(),
            best_step=self.checkpoints.best_step(),
            best_metric=None if self.valid is None else self.selection_metric(),
        )

    def _plot(self) -> Path | None:
        if not self.primary:
            return None
        try:
            return plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "loss_curve.png")
        except Exception as e:  # a plotting problem must not lose a finished run
            self.print(f"warning: could not draw the loss curve: {e}")
            return None


# =============================================================================================================
# 6. Setting up a run: data specs and corpus fingerprints
# =============================================================================================================
