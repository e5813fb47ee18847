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

Keeping the device busy (issue 11): every program the run needs (the train step for the batch shape, the eval
step, the decoders of the evaluations) starts compiling ahead, in parallel threads (`jax_transformer.compilation`),
loading what the persistent compilation cache holds; the loop waits for the train step only, and for the others
just before the evaluation that needs them. In the loop, batches are
prepared and put on the device ahead by a background thread (`Prefetcher`), and a step is dispatched without
waiting for the previous one: its loss sums are fetched once they are ready (at most `STEPS_AHEAD` steps behind),
and always before an evaluation or a save, so a non-finite loss still stops the run before anything is saved
and names the step it appeared at. Wall time is booked by phase (setup, compile, steps, eval, checkpoint;
`PhaseTimes`), into metrics.jsonl and the progress bar, so compilation is reported apart from training.

Setting up a run (data, tokenizer, config, initial or restored state) is `jax_transformer.run`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jax_transformer.checkpoint import CheckpointError
from jax_transformer.checks import TokenError, check_batch
from jax_transformer.compilation import OFF, CompileJobs, CompileLog
from jax_transformer.config import ConfigError, OptimConfig, TransformerConfig, setting, settings_from_dict
from jax_transformer.data import Corpus, DataError, EncodedCorpus, eval_batches
from jax_transformer.decoding import TRANSLATE_BATCH_SIZE, compile_translation, encode_sources, translation_shapes
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
    compilation_cache: str | None = setting(
        None,
        "folder of JAX's persistent compilation cache (compiled programs and GPU autotuning reused by later "
        f"runs), or '{OFF}' (default: $JAX_COMPILATION_CACHE_DIR, else ~/.cache/jax_transformer/xla)",
    )
    compile_ahead: bool = setting(
        True, "compile the train step, eval step and decoders ahead in parallel threads, each waited for when needed"
    )
    profile: str | None = setting(
        None, "write a jax.profiler trace of steps START:STOP (e.g. 20:25) into <run>/profile (TensorBoard, Perfetto)"
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
        if self.compilation_cache is not None and not str(self.compilation_cache).strip():
            raise ConfigError(f"loop field 'compilation_cache' must be a folder or '{OFF}', got an empty string")
        self.profile_steps()  # checks the form

    def profile_steps(self) -> tuple[int, int] | None:
        """`profile` as (first step, last step), both counted from 1 and traced; None when not asked for."""
        if self.profile is None:
            return None
        try:
            start, stop = (int(part) for part in str(self.profile).split(":"))
        except ValueError:
            start = stop = 0
        if not 1 <= start <= stop:
            raise ConfigError(
                f"loop field 'profile' must be START:STOP with 1 <= START <= STOP (steps counted from 1), "
                f"got {self.profile!r}"
            )
        return start, stop

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
    def from_encoded(
        cls, encoded: EncodedCorpus, corpus: Corpus, max_tokens: int, batching: str = "packed"
    ) -> ValidationSet:
        """`encoded` = encode_corpus(corpus, ...); pairs skipped as too long are left out of both forms. Packed
        (the default) gives every loss batch one shape, rows of the longest validation pair rounded up to 8, so the
        eval step compiles once."""
        batches = [batch for batch, _ in eval_batches(encoded, max_tokens, batching=batching)]
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


class Prefetcher:
    """Batches from a stream, each prepared (e.g. put on the device) `depth` batches ahead by a background thread,
    so the loop never waits for the host to cut and copy a batch. Yields (batch, the stream's position after it):
    the position a checkpoint taken after that batch's step must store, while the stream itself is ahead."""

    def __init__(self, stream, prepare: Callable[[Any], Any], depth: int = 4) -> None:
        self._stream, self._prepare = stream, prepare
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="prefetch", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        while not self._stop.is_set():
            try:
                item = (self._prepare(next(self._stream)), self._stream.state(), None)
            except BaseException as e:  # handed to the consumer, which raises it where the batch was wanted
                item = (None, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        batch, position, error = self._queue.get()
        if error is not None:
            raise error
        return batch, position

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._thread.join(timeout=10)


PHASES = ("setup", "compile", "steps", "eval", "checkpoint")


class PhaseTimes:
    """Wall seconds of a run by phase. Compilation the loop's own thread does inside another phase (a shape not
    compiled ahead) is moved from that phase to "compile", from the jax.monitoring events `CompileLog` counts;
    compilation in the background threads of `CompileJobs` is not: the loop did not wait for it."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def phase(self, name: str):
        compiled_before, start = CompileLog.snapshot()["thread_seconds"], time.perf_counter()
        try:
            yield
        finally:
            wall = time.perf_counter() - start
            compiled = 0.0 if name == "compile" else CompileLog.snapshot()["thread_seconds"] - compiled_before
            compiled = min(wall, compiled)
            self.seconds[name] += wall - compiled
            self.seconds["compile"] += compiled

    def record(self) -> dict[str, float]:
        """{"<phase>_s": seconds} for metrics.jsonl."""
        return {f"{name}_s": round(value, 2) for name, value in self.seconds.items()}


# How many steps the loop may dispatch before it waits for the oldest one's loss sums.
STEPS_AHEAD = 2


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
        if valid is not None:  # checked once here; training batches are checked as they are prepared (`_prepare`)
            for i, batch in enumerate(valid.batches):
                self._check(batch, f"validation batch {i}")
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl") if self.primary else DiscardedMetrics()
        self._decided: tuple[int, str | None] | None = None  # (step, agreed stop reason) in multi-process runs
        self.early = EarlyStopping.from_dict(loop_state)
        # A resumed state is already on disk under its step; orbax cannot save a step twice.
        self.last_saved_step: int | None = self.step if self.step in checkpoints.steps() else None
        self.data_state = stream.state()  # the stream's position after the last batch a dispatched step took
        self.times = PhaseTimes()
        self._in_flight: collections.deque = collections.deque()  # (step, lr, loss sums still on the device)
        self._profiling = False
        self._compiling: CompileJobs | None = None  # programs compiling ahead, in background threads

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
        """Checkpoints the state after the last dispatched step (its loss sums must have been checked: `_retire`)."""
        if self.last_saved_step == self.step:
            return
        with self.times.phase("checkpoint"):
            state = state_for_saving(self.parallel.local(self.state))
            try:
                self.checkpoints.save(
                    self.step,
                    state,
                    config=self.config,
                    optim=self.optim.to_dict(),
                    tokenizer=self.tokenizer,
                    data_state=self.data_state,
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
        with self.times.phase("eval"):
            return self._evaluate(final=final, counted=counted)

    def _bleu_sentences(self, final: bool) -> int:
        """How many validation sentences an evaluation translates: the final one every sentence, evaluations
        during training the first `eval_sentences` (None: all); 0 turns BLEU off in both."""
        limit, n = self.loop.eval_sentences, len(self.valid.sources)
        if limit == 0 or (limit is not None and not final):
            n = min(n, limit)
        return n

    def _evaluate(self, *, final: bool, counted: bool) -> tuple[dict[str, Any], list]:
        beam_size = self.loop.beam_size if final else self.loop.eval_beam_size
        params = self.host_params()
        result = {f"valid_{k}": v for k, v in evaluate_loss(params, self.eval_step, self.valid.batches).items()}
        samples = []
        n = self._bleu_sentences(final)
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

    # --- compiling ahead ---------------------------------------------------------------------------------------
    def compile_jobs(self) -> dict[str, dict[str, Callable[[], Any]]]:
        """Every program the run will call, as {when it is first needed: {name: a function compiling it}}: "train"
        (the train step for each batch shape), "eval" (the eval step for each validation batch shape, and the
        decoders of the evaluations during training), "final" (the decoders of the final evaluation). Each lowers
        with arguments of the very shapes and types the loop passes later, so the loop's calls find them compiled."""
        jobs: dict[str, dict[str, Callable[[], Any]]] = {"train": {}, "eval": {}, "final": {}}
        if hasattr(self.train_step, "lower") and hasattr(self.stream, "example_batches"):
            for batch in self.stream.example_batches():
                name = f"train step {batch['src'].shape}"
                batch = self.parallel.place_batch(batch)
                jobs["train"][name] = lambda b=batch: self.train_step.lower(self.state, b).compile()
        if self.valid is None:
            return jobs
        params = self.host_params()
        for batch in {b["src"].shape: b for b in self.valid.batches}.values():
            jobs["eval"][f"eval step {batch['src'].shape}"] = lambda b=batch: self.eval_step.lower(params, b).compile()
        lengths = [len(ids) for ids in encode_sources(self.tokenizer, self.valid.sources, self.config)]
        for when, beam_size in (("eval", self.loop.eval_beam_size), ("final", self.loop.beam_size)):
            n = self._bleu_sentences(when == "final")
            if n > 0:
                shapes = translation_shapes(lengths[:n], TRANSLATE_BATCH_SIZE, self.config.max_len)
                jobs[when].update(compile_translation(params, self.config, shapes, beam_size=beam_size))
        for name in jobs["eval"]:
            jobs["final"].pop(name, None)  # the same decoder, when the final evaluation uses the same beam
        return jobs

    def compile_ahead(self) -> None:
        """Starts compiling `compile_jobs()` in parallel threads (loading what the persistent cache holds) and
        waits for the train step only; `_wait_for_compiles` waits for the others when they are needed."""
        self._compile_start = CompileLog.snapshot()
        jobs = self.compile_jobs()
        self._compile_groups = {when: list(group) for when, group in jobs.items()}
        self._compiling = CompileJobs({name: job for group in jobs.values() for name, job in group.items()})
        n = len(self._compiling.names)
        self.print(f"compiling {n} programs ahead, in parallel ({', '.join(self._compiling.names)})")
        self._wait_for_compiles("train")

    def _wait_for_compiles(self, *groups: str) -> None:
        """Blocks until the programs compiled ahead for these groups are ready (booked as compile time); once
        every job is done, logs what was compiled and loaded."""
        if self._compiling is None:
            return
        with self.times.phase("compile"):
            for when in groups:
                self._compiling.wait(self._compile_groups[when])
        if self._compiling.done():
            self._log_compiles()

    def _log_compiles(self) -> None:
        running, self._compiling = self._compiling, None
        running.close()
        done = CompileLog.since(self._compile_start)
        cache = jax.config.values["jax_compilation_cache_dir"]
        self.metrics.write(
            {
                "kind": "compile",
                "step": self.step,
                "programs": sorted(running.names),
                "seconds": round(sum(running.seconds.values()), 2),  # of compile work, in parallel threads
                "waited_s": round(self.times.seconds["compile"], 2),  # the loop's wait for it
                "compiles": int(done["compiles"]),
                "cache_dir": cache,
                "cache_hits": int(done["hits"]),
                "cache_misses": int(done["misses"]),
                "errors": running.errors,
                "elapsed_s": round(time.time() - self.start_time, 1),
            }
        )
        where = f"cache {cache}: {done['hits']} loaded, {done['misses']} compiled and stored" if cache else "no cache"
        self.print(
            f"compiled {len(running.seconds)} programs ahead: {sum(running.seconds.values()):.1f} s of compile work, "
            f"{self.times.seconds['compile']:.1f} s waited for ({where})"
        )
        for name, error in running.errors.items():
            self.print(f"warning: compiling {name} ahead failed ({error}); it compiles when first called")

    # --- one step ------------------------------------------------------------------------------------------------
    def _prepare(self, batch):
        """Runs in the prefetch thread: the batch checked on the host (`_check`), then placed on the devices."""
        self._prepared += 1
        return self.parallel.place_batch(self._check(batch, f"training batch {self._prepared}"))

    def _dispatch(self) -> None:
        """Starts the next step on the device and returns without waiting for it."""
        lr = float(noam_rate(self.step + 1, self.config.d_model, self.optim.warmup_steps, self.optim.lr_scale))
        batch, self.data_state = next(self.batches)
        self.state, sums = self.train_step(self.state, batch)
        self.step += 1
        self._in_flight.append((self.step, lr, sums))

    def _retire(self, bar, *, wait: bool) -> None:
        """Logs the dispatched steps whose loss sums are ready; with `wait`, all of them (blocking), otherwise at
        least enough that no more than STEPS_AHEAD remain in flight. Raises TrainingError on a non-finite loss."""
        while self._in_flight:
            step, lr, sums = self._in_flight[0]
            ready = all(x.is_ready() for x in jax.tree_util.tree_leaves(sums) if hasattr(x, "is_ready"))
            if not (wait or ready or len(self._in_flight) > STEPS_AHEAD):
                return
            self._in_flight.popleft()
            # summed over devices: every device holds the total
            self._log_step(step, lr, jax.device_get(self.parallel.local(sums)), bar)

    def _log_step(self, step: int, lr: float, sums, bar) -> None:
        stats = summarize(sums)
        if not math.isfinite(stats["loss"]):
            # The update of this step came from a non-finite gradient, so the state (and every later one) is
            # ruined. Stop without saving it: the last checkpoint on disk stays the last good one.
            self._in_flight.clear()
            self.metrics.write(
                {"kind": "train", "step": step, "lr": lr, "loss": stats["loss"], "error": "non-finite loss"}
            )
            raise TrainingError(
                f"step {step}: the training loss is {stats['loss']} (not finite); stopped without "
                f"saving. The last good checkpoint is step {self.checkpoints.latest_step()} in "
                f"{self.checkpoints.directory}. Try a lower --lr-scale, a longer --warmup-steps or --clip-norm."
            )
        tokens, start = self._window
        tokens, now = tokens + stats["tokens"], time.time()
        tokens_per_s = tokens / max(now - start, 1e-9)
        self._window = (0.0, now) if now - start > 10.0 else (tokens, start)  # a ~10 second window
        self.metrics.write(
            {
                "kind": "train",
                "step": step,
                "lr": lr,
                "tokens_per_s": round(tokens_per_s, 1),
                "elapsed_s": round(now - self.start_time, 1),
                "compile_s": round(self.times.seconds["compile"], 1),
                **stats,
            }
        )
        bar.update(1)
        bar.set_postfix(
            loss=f"{stats['loss']:.3f}",
            lr=f"{lr:.2e}",
            tok_s=f"{tokens_per_s:.0f}",
            compile=f"{self.times.seconds['compile']:.0f}s",
            refresh=False,
        )

    def _step(self, bar) -> None:
        """Dispatches one step (starting or ending a profile around it), logs those that finished."""
        profile = self.loop.profile_steps()
        with self.times.phase("steps"):
            if profile and self.step + 1 == profile[0]:
                self._retire(bar, wait=True)  # the trace holds exactly the asked steps
                jax.profiler.start_trace(str(self.run_dir / "profile"), create_perfetto_trace=True)
                self._profiling = True
            self._dispatch()
            if self._profiling and self.step == profile[1]:
                self._stop_profile(bar)
            self._retire(bar, wait=False)
        if self._compiling is not None and self._compiling.done():
            bar.clear()
            self._log_compiles()

    def _drain(self, bar) -> None:
        """Waits for every dispatched step and logs it: before anything reads or saves the state."""
        with self.times.phase("steps"):
            self._retire(bar, wait=True)

    def _stop_profile(self, bar) -> None:
        self._retire(bar, wait=True)
        jax.profiler.stop_trace()
        self._profiling = False
        bar.clear()
        self.print(
            f"profile of steps {self.loop.profile} written to {self.run_dir / 'profile'} (TensorBoard, Perfetto)"
        )

    # --- the loop --------------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        from tqdm.auto import tqdm

        loop = self.loop
        self.times.seconds["setup"] = time.time() - self.start_time  # data, tokenizer, model: before the loop
        bar = tqdm(
            total=loop.steps,
            initial=self.step,
            unit="step",
            disable=not (loop.progress and self.primary),
            dynamic_ncols=True,
            mininterval=1.0,
        )
        self._window = (0.0, time.time())  # tokens and start time of the tokens/s window
        self._prepared = self.step  # training batches prepared so far (for the messages of `_check`)
        self.batches = Prefetcher(self.stream, self._prepare)  # batches checked and on the devices, ahead
        try:
            with StopSignals() as signals:
                if loop.compile_ahead:
                    self.compile_ahead()  # the first batches are prepared meanwhile; a signal stops after it
                if self._eval_due():  # resumed from a step whose evaluation a signal pre-empted: do it now
                    # (early stopping counts it as the uninterrupted run did; that step's checkpoint is already on
                    # disk without a score, so it cannot become the best one)
                    self._wait_for_compiles("eval")
                    self._validate()
                stopped_by = self._stop_reason(signals)
                while stopped_by is None:
                    self._step(bar)
                    # An evaluation step is evaluated (and counted by early stopping) however the run ends after
                    # it, except at a signal, which should stop quickly; the resumed run makes up for it. The
                    # reason is the one all processes agreed on, so they evaluate and save together.
                    stopped_by = self._stop_reason(signals)
                    if not (stopped_by or "").startswith("SIG") and self._eval_due():
                        self._drain(bar)  # a non-finite loss stops the run before anything else
                        bar.clear()
                        self._wait_for_compiles("eval")
                        self._validate()
                        self._decided = None  # early stopping may have a reason now: ask again
                        stopped_by = self._stop_reason(signals)
                    if stopped_by is None and self.step % loop.save_every == 0:
                        self._drain(bar)
                        self.save()  # (at the last step the final save below does it)
                self._drain(bar)
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
                self._wait_for_compiles("eval", "final")
                final, samples, score = self._final_evaluation()
                self.report(final, samples, final=True)
                self.save(metrics=None if score is None else {"score": score})
            else:
                self.save()
            return self._result(stopped_by, final, samples)
        finally:
            bar.close()
            self.batches.close()
            if self._compiling is not None:  # stopped early: drop the compile jobs not started yet
                self._compiling.close()
            if self._profiling:
                jax.profiler.stop_trace()
                self._profiling = False
            try:
                with self.times.phase("checkpoint"):
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
            self._finish(),
            best_step=self.checkpoints.best_step(),
            best_metric=None if self.valid is None else self.selection_metric(),
        )

    def _finish(self) -> Path | None:
        """The run's summary: a last metrics record with the wall time by phase, a line of it, the loss curve."""
        with self.times.phase("checkpoint"):
            self.checkpoints.wait()
        wall = time.time() - self.start_time
        self.metrics.write({"kind": "summary", "step": self.step, "elapsed_s": round(wall, 1), **self.times.record()})
        shares = ", ".join(f"{name} {value:.0f} s" for name, value in self.times.seconds.items())
        self.print(f"wall time {wall:.0f} s: {shares}")
        return self._plot()

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
