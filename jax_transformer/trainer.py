"""The training run loop: batches in, steps, evaluations, checkpoints, metrics and a progress bar, until a stop.

`Trainer.run` takes batches from a `BatchStream`, applies the compiled step of `jax_transformer.training`, and
every `eval_every` steps measures the validation loss and BLEU (`jax_transformer.evaluation`), keeping the best
checkpoint; every `save_every` steps it saves one (`jax_transformer.checkpoint`). It stops at the step budget,
the wall-time budget, a SIGINT/SIGTERM (after saving) or a non-finite loss (without saving, so the last good
checkpoint stays the last one). Each step and evaluation is a line of `<run>/metrics.jsonl`, drawn as
`<run>/loss_curve.png` at the end.

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

    def __post_init__(self) -> None:
        for name in ("eval_every", "save_every", "keep", "eval_beam_size", "beam_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"loop field {name!r} must be an int >= 1, got {value!r}")
        for name in ("steps", "samples", "eval_sentences"):  # steps 0: save the initial state and stop
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(f"loop field {name!r} must be an int >= 0, got {value!r}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ConfigError(f"loop field 'max_minutes' must be > 0, got {self.max_minutes}")
        if not self.alpha >= 0:
            raise ConfigError(f"loop field 'alpha' must be >= 0, got {self.alpha}")

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
class RunResult:
    """How a `Trainer.run` ended."""

    step: int
    stopped_by: str  # "steps", "time", "SIGINT", "SIGTERM"
    final_eval: dict[str, float] | None
    samples: list[tuple[str, str, str]]  # (source, reference, hypothesis)
    curve: Path | None
    checkpoint_dir: Path | None = None  # where the checkpoints are
    best_step: int | None = None  # the checkpoint evaluate/translate/export use by default


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
    ) -> None:
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
            )
        except CheckpointError as e:
            raise self._save_failed(e) from None
        self.last_saved_step = self.step

    def _save_failed(self, error: CheckpointError) -> CheckpointError:
        return CheckpointError(f"training stopped at step {self.step}: {error}. Resume with --resume {self.run_dir}")

    def evaluate(self, *, beam_size: int, final: bool = False) -> tuple[dict[str, float], list]:
        """Validation loss/perplexity/accuracy, and BLEU/chrF of the translations (see `eval_sentences`)."""
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
        # The best checkpoint is chosen by BLEU when there is one, else by (minus) the validation loss.
        result["score"] = result.get("bleu", -result["valid_loss"])
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

    def report(self, result: Mapping[str, float], samples) -> None:
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
        for source, reference, hypothesis in samples:
            self.print(f"  source:    {source}\n  reference: {reference}\n  model:     {hypothesis}")

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
        if self.step >= self.loop.steps:
            return "steps"
        if self.loop.max_minutes is not None and time.time() - self.start_time >= 60.0 * self.loop.max_minutes:
            return "time"
        return None

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
                self.print(
                    f"stopped by {stopped_by} at step {self.step}; checkpoint saved in "
                    f"{self.checkpoints.directory} (resume with --resume {self.run_dir})"
                )
                return RunResult(self.step, stopped_by, None, [], self._plot())
            if stopped_by == "time":
                self.print(f"stopping at step {self.step}: --max-minutes {loop.max_minutes} reached")
            final, samples = None, []
            if self.valid is not None:
                final, samples = self.evaluate(beam_size=loop.beam_size, final=True)
                self.report(final, samples)
                self.save(metrics={"score": final["score"]})
            else:
                self.save()
            return RunResult(self.step, stopped_by, final, samples, self._plot())
        finally:
            bar.close()
            try:
                self.checkpoints.wait()  # never leave with a save half-written
            except CheckpointError as e:
                raise self._save_failed(e) from None
            finally:
                self.metrics.close()

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
