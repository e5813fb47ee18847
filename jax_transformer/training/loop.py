"""The training loop: `train_loop(run)` steps, evaluates, saves and stops; read it top to bottom.

Each step takes a batch that a background thread has already checked and put on the devices (`Prefetcher`), and
is dispatched without waiting for the one before (`PendingSteps` fetches loss sums up to STEPS_AHEAD steps late, and
always before an evaluation or a save). Every `eval_every` steps the loop validates (loss, BLEU) and saves with
the score, every `save_every` steps it saves; it stops at the step or time budget, at `patience` evaluations
without improvement (`EarlyStopping`), at SIGINT/SIGTERM (saving first) or at a non-finite loss (saving nothing).
In a multi-process run every process runs this loop on the same global batches and leaves it at the same step
(`Stopping`: the reasons are agreed at each step); process 0 alone prints and writes metrics.jsonl.
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

from jax_transformer import files
from jax_transformer.checkpoint.manager import CheckpointManager
from jax_transformer.checks import check_batch
from jax_transformer.compilation import CompileJobs, CompileLog
from jax_transformer.data.batching import ValidationSet
from jax_transformer.data.tokenizer import Tokenizer
from jax_transformer.decoding.evaluation import describe_pairs, evaluate_translations, first_rows, spread_indices
from jax_transformer.decoding.translation import (
    TRANSLATE_BATCH_SIZE,
    compile_translation,
    encode_sources,
    plan_translation,
)
from jax_transformer.errors import CheckpointError, DataError, TokenError, TrainingError, UsageError
from jax_transformer.settings.config import DecodeConfig, LoopConfig, OptimConfig, TransformerConfig
from jax_transformer.training.distributed import DataParallel, agree_on_stop, is_primary
from jax_transformer.training.trainer import (
    TrainState,
    evaluate_loss,
    learning_rate_schedule,
    make_eval_step,
    state_for_saving,
    summarize,
)

STEPS_AHEAD = 2  # steps the loop may dispatch before it waits for the oldest one's loss sums
PHASES = ("setup", "compile", "steps", "eval", "checkpoint")


@dataclasses.dataclass
class Run:
    """Everything the loop needs: built by `jax_transformer.training.run.prepare` (or by hand, in tests). Validation
    batches are checked here, once; training batches as they are prepared."""

    config: TransformerConfig
    optim: OptimConfig
    loop: LoopConfig
    tokenizer: Tokenizer
    stream: Any  # a BatchStream: batches, and its position (`state()`), positioned to match `state`
    state: TrainState  # fresh or restored
    run_dir: Path
    checkpoints: CheckpointManager
    valid: ValidationSet | None = None
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)  # the run settings every checkpoint stores
    devices: DataParallel = dataclasses.field(default_factory=DataParallel)
    train_step: Callable | None = None  # the compiled step; default `devices.make_step(config, optim)`
    start_time: float = dataclasses.field(default_factory=time.time)
    print: Callable[[str], None] = print
    loop_state: Mapping[str, Any] | None = None  # a restored checkpoint's (early stopping's best and count)
    on_step: Callable[[int, Callable[[], None]], None] | None = None  # after each step: (step, drain); tests
    lock: Any = None  # the run directory's lock (`run.lock_run_dir`), released by `run.close`
    decode: DecodeConfig = dataclasses.field(default_factory=DecodeConfig)  # the rules evaluations decode by

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        if self.train_step is None:
            self.train_step = self.devices.make_step(self.config, self.optim)
        if self.valid is not None:
            for i, batch in enumerate(self.valid.batches):
                checked_batch(batch, self.config, f"validation batch {i}")


@dataclasses.dataclass
class RunResult:
    """How a run ended."""

    step: int
    stopped_by: str  # "steps", "time", "patience", "SIGINT", "SIGTERM"
    final_eval: dict[str, float] | None
    samples: list[tuple[str, str, str]]  # (source, reference, hypothesis)
    curve: Path | None
    checkpoint_dir: Path | None = None
    best_step: int | None = None  # the checkpoint evaluate/translate/export use by default
    best_metric: str | None = None  # what chose it: "bleu" or "loss" (None: no validation score, the last step)
    best_by: str = ""  # the same, in words: "by validation bleu", "the last: no validation data", ...


# =============================================================================================================
# The loop
# =============================================================================================================


def train_loop(run: Run) -> RunResult:
    """Trains `run` until a reason to stop (see the module docstring), then evaluates and saves."""
    loop, out, times = run.loop, RunOutput(run), PhaseTimes()
    times.seconds["setup"] = time.time() - run.start_time  # data, tokenizer, model: before the loop
    step = int(jax.device_get(run.state.step))
    state = run.devices.place_state(run.state)
    data_state = run.stream.state()  # the stream's position after the batch of the last dispatched step
    early = EarlyStopping.from_dict(run.loop_state)
    evaluator = Evaluator(run, out, times)
    saver = Saver(run, times, first_step=step)
    in_flight = PendingSteps(run, out, times)
    compiles = CompileAhead(out, times)
    profile = Profile(loop.profile_steps(), run.run_dir / "profile", out)
    prepared = [step]  # training batches prepared so far, for the messages of `checked_batch`
    learning_rate = learning_rate_schedule(run.config.d_model, run.optim)  # of the update after `step` updates
    batches = Prefetcher(run.stream, lambda batch: prepare_batch(run, batch, prepared))
    out.start_bar(step)
    try:
        with StopSignals() as signals:
            stopping = Stopping(loop, early, run.start_time, signals)
            if loop.compile_ahead:  # everything the run will call, in threads; waits for the train step only
                compiles.start(compile_jobs(run, state, evaluator))
                compiles.wait(step, "train")
            if evaluator.due(step, early):  # resumed at an evaluation step a signal pre-empted: make it up
                compiles.wait(step, "eval")
                validate(evaluator, saver, early, step, state, data_state)
            reason = stopping.reason(step)
            while reason is None:
                with times.phase("steps"):
                    profile.before(step + 1, in_flight)
                    batch, next_state = next(batches)
                    lr = float(learning_rate(step))
                    state, sums = run.train_step(state, batch)
                    step, data_state = step + 1, next_state
                    in_flight.add(step, lr, sums)
                    profile.after(step, in_flight)
                    in_flight.retire(wait=False)
                if run.on_step is not None:
                    run.on_step(step, in_flight.drain)
                compiles.log_if_done(step)
                # The reason all processes agreed on: an evaluation step is evaluated however the run ends after it,
                # except at a signal, which should stop quickly (the resumed run makes the evaluation up).
                reason = stopping.reason(step)
                if not is_signal(reason) and evaluator.due(step, early):
                    in_flight.drain()  # a non-finite loss stops the run before anything else
                    compiles.wait(step, "eval")
                    validate(evaluator, saver, early, step, state, data_state)
                    reason = stopping.reason(step, again=True)  # early stopping may have a reason now
                if reason is None and is_due(step, loop.save_every):
                    in_flight.drain()
                    saver.save(step, state, data_state, early)  # (at the last step the final save does it)
            in_flight.drain()
        out.close_bar()
        if is_signal(reason):  # asked to stop: save quickly, no final evaluation
            saver.save(step, state, data_state, early)
            out.print(
                f"stopped by {reason} at step {step}; checkpoint saved in {run.checkpoints.directory} "
                f"(resume with --resume {run.run_dir})"
            )
            return summarize_run(run, out, times, step, reason, None, [])
        if reason == "time":
            out.print(f"stopping at step {step}: --max-minutes {loop.max_minutes} reached")
        elif reason == "patience":
            out.print(
                f"stopping at step {step}: validation {evaluator.metric()} has not improved for "
                f"{loop.patience} evaluations ({early.describe(evaluator.metric())})"
            )
        final, samples, score = None, [], None
        if run.valid is not None:
            compiles.wait(step, "eval", "final")
            final, samples, score = final_evaluation(evaluator, early, step, state)
            evaluator.report(final, samples, step, final=True)
        saver.save(step, state, data_state, early, score=score)
        return summarize_run(run, out, times, step, reason, final, samples)
    finally:
        out.close_bar()
        batches.close()
        compiles.close()
        profile.close()
        try:
            with times.phase("checkpoint"):
                run.checkpoints.wait()  # never leave with a save half-written
        except CheckpointError as e:
            raise saver.failed(e, step) from None
        finally:
            out.close()


def is_due(step: int, every: int) -> bool:
    """The periodic work of the loop: true at every `every`-th step."""
    return step > 0 and step % every == 0


def is_signal(reason: str | None) -> bool:
    return (reason or "").startswith("SIG")


def prepare_batch(run: Run, batch, prepared: list[int]):
    """Runs in the prefetch thread: the batch checked on the host, then placed on the devices."""
    prepared[0] += 1
    rows = run.stream.global_rows(batch) if hasattr(run.stream, "global_rows") else None  # a share of the batch
    return run.devices.place_batch(checked_batch(batch, run.config, f"training batch {prepared[0]}"), rows)


def checked_batch(batch, config: TransformerConfig, where: str):
    """The batch boundary: a bad batch is a DataError before it reaches the compiled step (and its donated
    state), never NaN logits or a silently wrong embedding row."""
    try:
        check_batch(batch, config, where)
    except TokenError as e:
        raise DataError(f"{e} (the batches do not fit the model; is the tokenizer the model's?)") from None
    return batch


def validate(evaluator: Evaluator, saver: Saver, early: EarlyStopping, step: int, state, data_state) -> None:
    """The evaluation every `eval_every` steps: scored, counted by early stopping, saved with its score."""
    result, samples = evaluator.evaluate(evaluator.params(state), step, early=early)
    evaluator.report(result, samples[:2], step)
    if evaluator.loop.patience is not None:
        evaluator.out.print(
            f"  early stopping: {early.bad_evals} of {evaluator.loop.patience} evaluations without improvement "
            f"({early.describe(evaluator.metric())})"
        )
    saver.save(step, state, data_state, early, score=result["score"])


def final_evaluation(evaluator: Evaluator, early: EarlyStopping, step: int, state):
    """The final report (beam_size, every sentence) and the selection score of the last step: the score an
    evaluation during training gives it, so that it competes fairly for "best" (a beam-4 BLEU on every sentence
    never competes with greedy ones). An evaluation made only for that score is not counted by early stopping: an
    uninterrupted run would not have made it."""
    params, loop = evaluator.params(state), evaluator.loop
    final, samples = evaluator.evaluate(params, step, final=True)
    if early.last_eval_step == step:  # evaluated at this step already (an eval_every step)
        return final, samples, early.last_score
    if evaluator.metric() == "loss":  # the loss does not depend on the decoding settings
        return final, samples, -final["valid_loss"]
    n = len(evaluator.valid.sources)
    if evaluator.decoding(final=False) == evaluator.decoding(final=True) and (loop.eval_sentences or n) >= n:
        return final, samples, final.get("bleu")  # the training-time evaluation would decode the same
    selection, _ = evaluator.evaluate(params, step)
    return final, samples, selection["score"]


def summarize_run(run: Run, out: RunOutput, times: PhaseTimes, step: int, reason: str, final, samples) -> RunResult:
    """The run's summary (wall time by phase, a metrics record, the loss curve) and its result."""
    with times.phase("checkpoint"):
        run.checkpoints.wait()  # the best step is known once every save is on disk
    wall = time.time() - run.start_time
    out.metrics.write({"kind": "summary", "step": step, "elapsed_s": round(wall, 1), **times.record()})
    out.print(f"wall time {wall:.0f} s: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.seconds.items()))
    metric = None if run.valid is None else Evaluator.selection_metric(run.loop, run.valid)
    best_by = "the last: no validation data" if metric is None else f"by validation {metric}"
    if metric is not None and run.checkpoints.scored_best_step() is None:  # every evaluation's decoding failed
        metric, best_by = None, f"the last: no evaluation computed a validation {metric}"
    return RunResult(
        step,
        reason,
        final,
        samples,
        out.plot(),
        best_step=run.checkpoints.best_step(),
        best_metric=metric,
        best_by=best_by,
    )


# =============================================================================================================
# Stopping: signals, early stopping, budgets, and one decision for all processes
# =============================================================================================================


class StopSignals:
    """Turns SIGINT / SIGTERM into a flag the loop checks after each step, so it can save and exit cleanly.
    A second signal of the same kind restores the default behaviour (a second Ctrl-C kills at once)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous = {}

    def __enter__(self) -> StopSignals:
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

    def describe(self, metric: str) -> str:
        if self.best_score is None:
            return "no score yet"
        best = f"BLEU {self.best_score:.2f}" if metric == "bleu" else f"loss {-self.best_score:.3f}"
        return f"best {best} at step {self.best_step}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> EarlyStopping:
        """From a checkpoint's `loop_state` (None: a checkpoint from before early stopping: start afresh)."""
        return cls(**(values or {}).get("early_stopping", {}))


class Stopping:
    """Why to stop after a step, or None. `local_reason` is the one place that collects this process's reasons (a
    signal, patience, the step budget, the time budget); in a multi-process run `reason` agrees on one with the
    other processes once per step (`distributed.agree_on_stop`: process 0's reason first)."""

    def __init__(self, loop: LoopConfig, early: EarlyStopping, start_time: float, signals: StopSignals) -> None:
        self.loop, self.early, self.start_time, self.signals = loop, early, start_time, signals
        self._decided: tuple[int, str | None] | None = None

    def local_reason(self, step: int) -> str | None:
        if self.signals.received is not None:
            return signal.Signals(self.signals.received).name
        if self.loop.patience is not None and self.early.bad_evals >= self.loop.patience:
            return "patience"
        if step >= self.loop.steps:
            return "steps"
        if self.loop.max_minutes is not None and time.time() - self.start_time >= 60.0 * self.loop.max_minutes:
            return "time"
        return None

    def reason(self, step: int, *, again: bool = False) -> str | None:
        if jax.process_count() == 1:
            return self.local_reason(step)
        if again or self._decided is None or self._decided[0] != step:
            self._decided = (step, agree_on_stop(self.local_reason(step)))
        return self._decided[1]


# =============================================================================================================
# Keeping the devices busy: batches prepared ahead, steps dispatched ahead, programs compiled ahead, a profile
# =============================================================================================================


class Prefetcher:
    """Batches from a stream, each prepared (checked, put on the devices) `depth` batches ahead by a background
    thread, so the loop never waits for the host to cut and copy a batch. Yields (batch, the stream's position
    after it): the position a checkpoint taken after that batch's step must store, while the stream is ahead."""

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


class PendingSteps:
    """Steps dispatched but not yet logged: their loss sums are fetched once ready (at most STEPS_AHEAD behind) or
    when `drain` waits for all, before anything reads or saves the state. A non-finite loss raises TrainingError
    without saving: that step's update is ruined, so the last checkpoint on disk stays the last good one."""

    def __init__(self, run: Run, out: RunOutput, times: PhaseTimes) -> None:
        self.run, self.out, self.times = run, out, times
        self._steps: collections.deque = collections.deque()  # (step, lr, loss sums still on the device)
        self._window = (0.0, time.time())  # tokens and start time of the tokens/s window

    def add(self, step: int, lr: float, sums) -> None:
        self._steps.append((step, lr, sums))

    def retire(self, *, wait: bool) -> None:
        while self._steps:
            step, lr, sums = self._steps[0]
            ready = all(x.is_ready() for x in jax.tree_util.tree_leaves(sums) if hasattr(x, "is_ready"))
            if not (wait or ready or len(self._steps) > STEPS_AHEAD):
                return
            self._steps.popleft()
            # summed over devices: every device holds the total
            self._log(step, lr, summarize(jax.device_get(self.run.devices.local(sums))))

    def drain(self) -> None:
        with self.times.phase("steps"):
            self.retire(wait=True)

    def _log(self, step: int, lr: float, stats: dict[str, float]) -> None:
        if not math.isfinite(stats["loss"]):
            self._steps.clear()
            self.out.metrics.write(
                {"kind": "train", "step": step, "lr": lr, "loss": stats["loss"], "error": "non-finite loss"}
            )
            raise TrainingError(
                f"step {step}: the training loss is {stats['loss']} (not finite); stopped without saving. The last "
                f"good checkpoint is step {self.run.checkpoints.latest_step()} in {self.run.checkpoints.directory}. "
                f"Try a lower --lr-scale, a longer --warmup-steps or --clip-norm."
            )
        tokens, start = self._window
        tokens, now = tokens + stats["tokens"], time.time()
        tokens_per_s = tokens / max(now - start, 1e-9)
        self._window = (0.0, now) if now - start > 10.0 else (tokens, start)  # a ~10 second window
        compile_s = self.times.seconds["compile"]
        elapsed = round(now - self.run.start_time, 1)
        self.out.metrics.write(
            {
                "kind": "train",
                "step": step,
                "lr": lr,
                "tokens_per_s": round(tokens_per_s, 1),
                "elapsed_s": elapsed,
                "compile_s": round(compile_s, 1),
                **stats,
            }
        )
        self.out.advance(
            loss=f"{stats['loss']:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:.0f}", compile=f"{compile_s:.0f}s"
        )


def compile_jobs(run: Run, state, evaluator: Evaluator) -> dict[str, dict[str, Callable[[], Any]]]:
    """Every program the run will call, as {when it is first needed: {name: a function compiling it}}: "train"
    (the train step for each batch shape), "eval" (the eval step for each validation batch shape, and the
    decoders of the evaluations during training), "final" (the decoders of the final evaluation). Each lowers
    with arguments of the very shapes and types the loop passes later, so the loop's calls find them compiled."""
    jobs: dict[str, dict[str, Callable[[], Any]]] = {"train": {}, "eval": {}, "final": {}}
    if hasattr(run.train_step, "lower") and hasattr(run.stream, "example_batches"):
        for batch in run.stream.example_batches():
            name = f"train step {batch['src'].shape}"
            batch = run.devices.place_batch(batch)
            jobs["train"][name] = lambda b=batch: run.train_step.lower(state, b).compile()
    if run.valid is None:
        return jobs
    params = evaluator.params(state)
    for batch in {b["src"].shape: b for b in run.valid.batches}.values():
        jobs["eval"][f"eval step {batch['src'].shape}"] = lambda b=batch: evaluator.eval_step.lower(params, b).compile()
    lengths = [len(ids) for ids in encode_sources(run.tokenizer, run.valid.sources, run.config)]
    for when in ("eval", "final"):
        n = evaluator.sentences(final=when == "final")
        if n > 0:
            plan = plan_translation(lengths[:n], TRANSLATE_BATCH_SIZE, run.config.max_len)
            jobs[when].update(compile_translation(params, run.config, plan, evaluator.decoding(final=when == "final")))
    for name in jobs["eval"]:
        jobs["final"].pop(name, None)  # the same decoder, when the final evaluation uses the same beam
    return jobs


class CompileAhead:
    """The run's programs compiling in background threads (`compilation.CompileJobs`, loading what the persistent
    cache holds); `wait` blocks, as compile time, until a group is ready; once all are, one metrics record and
    one line say what was compiled and loaded."""

    def __init__(self, out: RunOutput, times: PhaseTimes) -> None:
        self.out, self.times = out, times
        self._jobs: CompileJobs | None = None

    def start(self, jobs: dict[str, dict[str, Callable[[], Any]]]) -> None:
        self._before = CompileLog.snapshot()
        self._groups = {when: list(group) for when, group in jobs.items()}
        self._jobs = CompileJobs({name: job for group in jobs.values() for name, job in group.items()})
        names = self._jobs.names
        self.out.print(f"compiling {len(names)} programs ahead, in parallel ({', '.join(names)})")

    def wait(self, step: int, *groups: str) -> None:
        if self._jobs is None:
            return
        with self.times.phase("compile"):
            for when in groups:
                self._jobs.wait(self._groups[when])
        self.log_if_done(step)

    def log_if_done(self, step: int) -> None:
        if self._jobs is None or not self._jobs.done():
            return
        jobs, self._jobs = self._jobs, None
        jobs.close()
        done = CompileLog.since(self._before)
        cache = jax.config.values["jax_compilation_cache_dir"]
        work, waited = sum(jobs.seconds.values()), self.times.seconds["compile"]
        self.out.clear_bar()
        self.out.metrics.write(
            {
                "kind": "compile",
                "step": step,
                "programs": sorted(jobs.names),
                "seconds": round(work, 2),  # of compile work, in parallel threads
                "waited_s": round(waited, 2),  # the loop's wait for it
                "compiles": int(done["compiles"]),
                "cache_dir": cache,
                "cache_hits": int(done["hits"]),
                "cache_misses": int(done["misses"]),
                "errors": jobs.errors,
                "elapsed_s": round(time.time() - self.out.start_time, 1),
            }
        )
        where = f"cache {cache}: {done['hits']} loaded, {done['misses']} compiled and stored" if cache else "no cache"
        self.out.print(
            f"compiled {len(jobs.seconds)} programs ahead: {work:.1f} s of compile work, {waited:.1f} s waited for "
            f"({where})"
        )
        for name, error in jobs.errors.items():
            self.out.print(f"warning: compiling {name} ahead failed ({error}); it compiles when first called")

    def close(self) -> None:
        """Drops the jobs not started yet (stopped early)."""
        if self._jobs is not None:
            self._jobs.close()


class Profile:
    """`--profile START:STOP`: a jax.profiler trace of exactly those steps (the steps before are drained first)."""

    def __init__(self, steps: tuple[int, int] | None, folder: Path, out: RunOutput) -> None:
        self.steps, self.folder, self.out, self.on = steps, folder, out, False

    def before(self, step: int, in_flight: PendingSteps) -> None:
        if self.steps and step == self.steps[0]:
            in_flight.retire(wait=True)
            jax.profiler.start_trace(str(self.folder), create_perfetto_trace=True)
            self.on = True

    def after(self, step: int, in_flight: PendingSteps) -> None:
        if self.on and step == self.steps[1]:
            in_flight.retire(wait=True)
            self.close()
            self.out.clear_bar()
            self.out.print(
                f"profile of steps {self.steps[0]}:{self.steps[1]} written to {self.folder} (TensorBoard, Perfetto)"
            )

    def close(self) -> None:
        if self.on:
            jax.profiler.stop_trace()
            self.on = False


# =============================================================================================================
# Evaluating and saving
# =============================================================================================================


class Evaluator:
    """Validation loss, perplexity, accuracy and BLEU/chrF, written to metrics.jsonl. During training with the
    training-time decoding (`eval_beam_size` on the first `eval_sentences` sentences) and a selection score
    ("score", higher is better: BLEU, or minus the loss), which early stopping counts; the final evaluation with
    `beam_size` on every sentence, as a report."""

    def __init__(self, run: Run, out: RunOutput, times: PhaseTimes) -> None:
        self.run, self.out, self.times = run, out, times
        self.loop, self.valid = run.loop, run.valid
        self.eval_step = make_eval_step(run.config, run.optim.label_smoothing)

    @staticmethod
    def selection_metric(loop: LoopConfig, valid: ValidationSet) -> str:
        """What the best checkpoint and early stopping compare: "bleu", or "loss" (asked for, or BLEU off)."""
        bleu_on = loop.eval_sentences != 0 and len(valid.sources) > 0
        return "bleu" if loop.best_metric == "bleu" and bleu_on else "loss"

    def metric(self) -> str:
        return self.selection_metric(self.loop, self.valid)

    def params(self, state):
        return self.run.devices.local(state).params

    def due(self, step: int, early: EarlyStopping) -> bool:
        """This step is an evaluation step not yet evaluated."""
        return self.valid is not None and is_due(step, self.loop.eval_every) and early.last_eval_step != step

    def sentences(self, final: bool) -> int:
        """How many validation sentences an evaluation translates: the final one every sentence, evaluations
        during training the first `eval_sentences` (None: all); 0 turns BLEU off in both."""
        limit, n = self.loop.eval_sentences, len(self.valid.sources)
        return min(n, limit) if limit == 0 or (limit is not None and not final) else n

    def evaluate(self, params, step: int, *, final: bool = False, early: EarlyStopping | None = None):
        """(result, samples); with `early`, the evaluation is counted by early stopping."""
        with self.times.phase("eval"):
            result = {f"valid_{k}": v for k, v in evaluate_loss(params, self.eval_step, self.valid.batches).items()}
            samples = []
            n = self.sentences(final)
            if n > 0:
                result, samples = self._bleu(params, step, n, final, result)
            if not final:
                result["score"] = -result["valid_loss"] if self.metric() == "loss" else result.get("bleu")
                result["score_metric"] = self.metric()
                if early is not None:
                    early.update(step, result["score"])
                    result.update(best_step=early.best_step, bad_evals=early.bad_evals)
            elapsed = round(time.time() - self.run.start_time, 1)
            self.out.metrics.write({"kind": "eval", "step": step, "final": final, "elapsed_s": elapsed, **result})
            return result, samples

    def decoding(self, final: bool) -> DecodeConfig:
        """How the evaluations decode: the run's decoding, its best hypothesis only, with --eval-beam-size during
        training."""
        from jax_transformer.settings.resolve import evaluation_decoding

        return evaluation_decoding(self.run.decode, None if final else self.loop.eval_beam_size)

    def _bleu(self, params, step: int, n: int, final: bool, result: dict[str, Any]):
        decode = self.decoding(final)
        rows = first_rows(self.valid.languages, n)
        sources, references = [self.valid.sources[i] for i in rows], [self.valid.references[i] for i in rows]
        languages = None if self.valid.languages is None else [self.valid.languages[i] for i in rows]
        try:
            scores, hypotheses = evaluate_translations(
                params,
                self.run.config,
                self.run.tokenizer,
                sources,
                references,
                decode,
                languages=languages,
                progress=self.loop.progress,
            )
        except Exception as e:  # a decoding failure must not end a long training run: warn, go on
            self.out.print(
                f"warning: step {step}: BLEU evaluation failed ({type(e).__name__}: {e}); continuing "
                f"with the validation loss only"
            )
            return {**result, "decode_error": f"{type(e).__name__}: {e}"}, []
        picked = spread_indices(len(sources), self.loop.samples)
        samples = [(sources[i], references[i], hypotheses[i]) for i in picked]
        return {**result, **scores, "beam_size": decode.beam_size, "sentences": len(sources)}, samples

    def report(self, result: Mapping[str, Any], samples, step: int, *, final: bool = False) -> None:
        self.out.clear_bar()
        line = (
            f"step {step}: valid loss {result['valid_loss']:.3f}, ppl {result['valid_ppl']:.2f}, "
            f"token accuracy {100 * result['valid_accuracy']:.1f}%"
        )
        if "bleu" in result:
            line += (
                f", BLEU {result['bleu']:.2f}, chrF {result['chrf']:.2f} "
                f"(sacrebleu, {result['sentences']} sentences, beam {result['beam_size']})"
            )
        else:
            line += " (no BLEU: decoding failed)" if "decode_error" in result else " (BLEU off: --eval-sentences 0)"
        self.out.print(line)
        if pairs := describe_pairs(result):
            self.out.print(f"  per language pair: {pairs}")
        if final and "bleu" in result:  # how the figures were computed, for the record
            self.out.print(
                f"  sacreBLEU {result['bleu_signature']}; chrF {result['chrf_signature']}; lowercased BLEU "
                f"{result['bleu_lc']:.2f} ({result['bleu_lc_signature']})"
            )
        for source, reference, hypothesis in samples:
            self.out.print(f"  source:    {source}\n  reference: {reference}\n  model:     {hypothesis}")


class Saver:
    """Checkpoints the state after a step (its loss sums checked first, by `PendingSteps.drain`) with everything a
    resume needs: config, optimiser settings, tokenizer, data position, run settings, early stopping's state."""

    def __init__(self, run: Run, times: PhaseTimes, first_step: int) -> None:
        self.run, self.times = run, times
        # A resumed state is already on disk under its step; orbax cannot save a step twice.
        self.last_saved = first_step if first_step in run.checkpoints.steps() else None

    def save(self, step: int, state, data_state, early: EarlyStopping, score: float | None = None) -> None:
        if self.last_saved == step:
            return
        run = self.run
        with self.times.phase("checkpoint"):
            try:
                run.checkpoints.save(
                    step,
                    state_for_saving(run.devices.global_view(state)),
                    config=run.config,
                    optim=run.optim.to_dict(),
                    tokenizer=run.tokenizer,
                    data_state=data_state,
                    run=run.settings,
                    metrics=None if score is None else {"score": score},
                    loop_state={"early_stopping": early.to_dict()},
                )
            except CheckpointError as e:
                raise self.failed(e, step) from None
        self.last_saved = step

    def failed(self, error: CheckpointError, step: int) -> CheckpointError:
        if not self.run.checkpoints.steps():  # nothing to resume from: the same command starts the run again
            return CheckpointError(
                f"training stopped at step {step}: {error}. No checkpoint of this run is complete, so there is "
                f"nothing to resume: run the same command again (it removes the half-written one)"
            )
        return CheckpointError(f"training stopped at step {step}: {error}. Resume with --resume {self.run.run_dir}")


# =============================================================================================================
# What the run shows: metrics.jsonl, the progress bar, printed lines (process 0), time by phase
# =============================================================================================================


class MetricsLog:
    """Appends one JSON object per line to `<run>/metrics.jsonl`: {"kind": "train" | "eval" | ..., "step": ...};
    with `board` (a tensorboardX SummaryWriter, `tensorboard_writer`) also each numeric field as the scalar
    "<kind>/<field>" at the record's step."""

    def __init__(self, path: str | os.PathLike, board=None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (open for the run)
        self._board = board

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        if self._board is None or "step" not in record:
            return
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                self._board.add_scalar(f"{record.get('kind', 'run')}/{key}", value, record["step"])
        if record.get("kind") != "train":  # the steps' records are flushed by the writer every few seconds
            self._board.flush()

    def close(self) -> None:
        self._file.close()
        if self._board is not None:
            self._board.close()


def tensorboard_writer(run_dir: Path, wanted: bool | None, first_step: int):
    """A tensorboardX SummaryWriter on `<run>/tensorboard` (None: not wanted, or `wanted` unsaid and tensorboardX
    not installed). A resumed run drops the events of the steps it trains again (`purge_step`), as metrics.jsonl
    drops their records."""
    SummaryWriter = tensorboard_writer_class(wanted)  # noqa: N806 (the class)
    if SummaryWriter is None:
        return None
    # Each command's own file (the file name's time has whole seconds only, and a second writer would replace it).
    suffix = f".from-step-{first_step}"
    return SummaryWriter(str(run_dir / "tensorboard"), purge_step=first_step, flush_secs=10, filename_suffix=suffix)


def tensorboard_writer_class(wanted: bool | None):
    """tensorboardX's SummaryWriter, or None (not wanted, or `wanted` unsaid and tensorboardX not installed); asked
    for (--tensorboard) and not installed, a UsageError naming the extra. `run.prepare` asks it before reading any
    data."""
    if wanted is False:
        return None
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        if wanted:
            raise UsageError(
                "--tensorboard: tensorboardX is not installed (pip install tensorboardX, or the project's "
                "tensorboard extra)"
            ) from None
        return None
    return SummaryWriter


class DiscardedMetrics:
    """What processes other than process 0 log to: nothing."""

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
    files.write_text(path, "".join(line + "\n" for line in kept))


class RunOutput:
    """Process 0's view of the run: printed lines, metrics.jsonl, the progress bar and the loss curve; the other
    processes of a multi-process run show nothing."""

    def __init__(self, run: Run) -> None:
        self.primary = is_primary()
        self.run_dir, self.start_time, self.loop = run.run_dir, run.start_time, run.loop
        self._print = run.print if self.primary else (lambda text: None)
        if self.primary:
            first = int(jax.device_get(run.state.step)) + 1  # the first step this command trains
            board = tensorboard_writer(run.run_dir, run.loop.tensorboard, first)
            self.metrics = MetricsLog(run.run_dir / "metrics.jsonl", board)
        else:
            self.metrics = DiscardedMetrics()
        self._bar = None

    def start_bar(self, step: int) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=self.loop.steps,
            initial=step,
            unit="step",
            disable=not (self.loop.progress and self.primary),
            dynamic_ncols=True,
            mininterval=1.0,
        )

    def advance(self, **postfix: str) -> None:
        self._bar.update(1)
        self._bar.set_postfix(refresh=False, **postfix)

    def clear_bar(self) -> None:
        if self._bar is not None:
            self._bar.clear()

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def print(self, text: str) -> None:
        self._print(text)

    def plot(self) -> Path | None:
        if not self.primary:
            return None
        from jax_transformer.training.curves import plot_metrics  # matplotlib: slow to import, not for `translate`

        try:
            return plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "loss_curve.png")
        except Exception as e:  # a plotting problem must not lose a finished run
            self.print(f"warning: could not draw the loss curve: {e}")
            return None

    def close(self) -> None:
        self.metrics.close()


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
