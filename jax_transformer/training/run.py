"""Setting up a training run, in the order the data flows, and running it: what `train.py train` calls.

    from jax_transformer.training import run
    result = run.train(run_dir="runs/de-en", preset_name="small",
                       data={"src": "train.de", "tgt": "train.en", "valid_src": "val.de", "valid_tgt": "val.en"},
                       optim={"warmup_steps": 300, "lr_scale": 0.5}, loop={"steps": 4000, "max_minutes": 50})
    result = run.train(resume="runs/de-en", loop={"steps": 8000})          # continue it, exactly

`prepare` goes: join the processes -> lock the run directory -> restore the checkpoint a resume continues ->
resolve the settings (`settings.resolve`) -> read the corpora -> the tokenizer, model config and weights (trained,
restored or imported from PyTorch) -> batches -> the train state -> a `loop.Run`. A resume checks that nothing
an exact continuation depends on has changed (data, tokenizer, optimiser, seed, model) and names what did.
In a multi-process run every process calls `prepare` with the same settings; process 0 alone trains the
tokenizer and writes the run directory's files, and the processes check that they agree before training.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax

from jax_transformer import compilation, files
from jax_transformer.checkpoint import manager as ckpt_lib
from jax_transformer.checkpoint.settings import stored_settings
from jax_transformer.data import token_arrays
from jax_transformer.data.batching import BatchStream, EncodedCorpus, SpecialIds, ValidationSet, encode_corpus
from jax_transformer.data.corpus import Corpus, PairReader, corpus_fingerprint
from jax_transformer.data.reading import load_corpus
from jax_transformer.data.tokenizer import Tokenizer, with_languages
from jax_transformer.errors import ConfigError, DataError, UsageError
from jax_transformer.interop import languages
from jax_transformer.settings import resolve as resolution
from jax_transformer.settings.config import (
    COMPUTE_FIELDS,
    LORA_FIELDS,
    DataConfig,
    ParallelConfig,
    TransformerConfig,
    check_decoding,
)
from jax_transformer.settings.resolve import RunSettings, resolve
from jax_transformer.training import distributed, finetuning
from jax_transformer.training.loop import Run, RunResult, tensorboard_writer_class, train_loop, truncate_metrics
from jax_transformer.training.trainer import TrainState, create_train_state, restore_train_state

__all__ = ["ConfigError", "UsageError", "prepare", "train"]


def train(*, print_fn: Callable[[str], None] = print, **arguments: Any) -> RunResult:
    """Prepares a run (see `prepare` for the arguments), trains it to its end and closes it."""
    try:
        run = prepare(print_fn=print_fn, **arguments)
        try:
            result = train_loop(run)
        finally:
            close(run)
    except BaseException as e:
        distributed.end_run(error=f"{type(e).__name__}: {e}")  # the other processes are told why this one ends
        raise
    distributed.end_run()
    return dataclasses.replace(result, checkpoint_dir=run.checkpoints.directory, best_step=run.checkpoints.best_step())


def close(run: Run) -> None:
    """Waits for the last save and releases the run directory."""
    try:
        run.checkpoints.close()
    finally:
        if run.lock is not None:
            run.lock.release()


def prepare(
    *,
    run_dir: str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    strict_resume: bool = False,
    lock: bool = True,
    init_from_torch: str | os.PathLike | None = None,
    init_from: str | os.PathLike | None = None,
    preset_name: str | None = None,
    seed: int | None = None,
    recipe: str | None = None,
    model: Mapping[str, Any] | None = None,
    data: Mapping[str, Any] | None = None,
    optim: Mapping[str, Any] | None = None,
    loop: Mapping[str, Any] | None = None,
    parallel: Mapping[str, Any] | None = None,
    decode: Mapping[str, Any] | None = None,
    start_time: float | None = None,
    print_fn: Callable[[str], None] = print,
) -> Run:
    """A training run ready for `loop.train_loop`; `close(run)` must follow (as `train` does).

    run_dir: where checkpoints, metrics.jsonl, loss_curve.png, tokenizer.model and config.json go (default
      runs/<date-time>); resume: continue the run in this directory from its newest intact checkpoint (no
      run_dir); strict_resume: refuse to resume when the newest checkpoint is damaged, instead of falling back;
    lock: hold the run directory's lock (`lock_run_dir`) until `close`; in a multi-process run process 0 alone
      takes it, and alone tidies the checkpoint folder on a resume;
    init_from_torch: start from the weights of a PyTorch file (`jax_transformer.interop.export`);
    init_from: start from a run directory's best checkpoint (`train.py import` writes one from a pretrained model):
      its weights, config and tokenizer, and the way it decodes;
    preset_name, seed, recipe, and model / data / optim / loop / parallel (partial dicts of the fields of
      TransformerConfig / DataConfig / OptimConfig / LoopConfig / ParallelConfig): what was asked for, completed
      by `settings.resolve.resolve` (a resumed checkpoint's settings, else the recipe's, else the defaults).
    """
    start_time = time.time() if start_time is None else start_time
    # First the processes join (before anything starts JAX's backends); from here on only process 0 prints.
    parallel_config = ParallelConfig.from_dict({k: v for k, v in (parallel or {}).items() if v is not None})
    distributed.initialize(parallel_config, print_fn)
    owner = lock and distributed.is_primary()
    print_fn = print_fn if distributed.is_primary() else _silent
    if sum(x is not None for x in (resume, init_from_torch, init_from)) > 1:
        raise UsageError("--resume, --init-from-torch and --init-from exclude each other: each gives the weights")
    run_dir, held = open_run_dir(run_dir, resume, init_from_torch, owner, print_fn)
    distributed.watch_run(run_dir, resume_command(run_dir, parallel_config))
    try:
        devices = distributed.DataParallel.from_config(parallel_config)
        # A sharded run reads its state straight onto the mesh, each process only its own shards.
        placement = devices.placement if devices.mode == "sharded" else None
        restored = (
            None
            if resume is None
            else restore_for_resume(run_dir, strict=strict_resume, owner=owner, print_fn=print_fn, placement=placement)
        )
        stored = None if restored is None else stored_settings(restored)
        start = None if init_from is None else ckpt_lib.load(init_from, "best", weights_only=True)
        inherited = None if start is None else inherited_settings(start)
        given = dict(preset=preset_name, seed=seed, recipe=recipe, model=model, data=data, optim=optim, loop=loop)
        given.update(decode=decode)
        settings = resolve({**given, "parallel": parallel_config.to_dict()}, stored, inherited)
        tensorboard_writer_class(settings.loop.tensorboard)  # --tensorboard without tensorboardX: an error now
        if settings.data.add_language and start is not None:  # (a resume has the code in its tokenizer already)
            start = languages.with_language(start, settings.data.add_language, settings.data.init_from_language)
            print_fn(f"added language {settings.data.add_language}: id {start.config.src_vocab_size - 1}")
        elif (settings.data.add_language or settings.data.init_from_language) and stored is None:
            raise UsageError("--add-language / --init-from-language extend the model of --init-from; give --init-from")
        corpus, valid_corpus = read_corpora(settings.data, stored, print_fn)
        config, tokenizer, params = model_and_tokenizer(
            settings, restored or start, init_from_torch, dict(model or {}), preset_name, corpus, run_dir, print_fn
        )
        if config.lora_rank or settings.optim.freeze:  # (the check traces the model's shapes: only when it can fail)
            print_fn(finetuning.describe(config, settings.optim.freeze))  # and checks --freeze against the model
        # The decodings of the evaluations, before anything is compiled or written (a run directory this process
        # made is removed again; in a multi-process run process 0 has written tokenizer.model already).
        if valid_corpus is not None:
            beams = {"--beam-size": [settings.decode.beam_size], "--eval-beam-size": [settings.loop.eval_beam_size]}
            given_decode = [k for k, v in (decode or {}).items() if v is not None]
            check_decoding(config, settings.decode, beams, given=given_decode)
        if start is not None:
            print_fn(f"starting from {start.directory} step {start.step} (its weights, tokenizer and decoding)")
            params, restored_for_state = start.params, None
        else:
            restored_for_state = restored
        # Before anything compiles; the decoders compiled ahead are stored as traced, for a `translate` after the run.
        cache_dir = compilation.use_cache(settings.loop.compilation_cache, print_fn, programs=True)
        stream, valid = batches(settings, config, tokenizer, corpus, valid_corpus, devices, restored, stored, print_fn)
        state = initial_state(restored_for_state, config, settings, params)
        stored_now = run_settings(settings, corpus, devices, imported_from(restored or start))
        agree_and_write(stored_now, config, settings, tokenizer, run_dir, restored)
        n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
        print_fn(
            f"model: {n_params:,} parameters, d_model {config.d_model}, {config.num_encoder_layers}+"
            f"{config.num_decoder_layers} layers, vocabulary {config.src_vocab_size}; {devices.describe()}; "
            f"{_describe_batches(stream)}; run directory {run_dir}; compilation cache {cache_dir or 'off'}"
        )
        if valid is not None:
            print_fn(f"decoding of the final evaluation: {settings.decode.describe()}")
        return Run(
            config=config,
            optim=settings.optim,
            loop=settings.loop,
            tokenizer=tokenizer,
            stream=stream,
            state=state,
            run_dir=run_dir,
            checkpoints=ckpt_lib.CheckpointManager(run_dir / ckpt_lib.CHECKPOINT_SUBDIR, keep=settings.loop.keep),
            valid=valid,
            settings=stored_now,
            devices=devices,
            start_time=start_time,
            print=print_fn,
            loop_state=None if restored is None else restored.loop_state,
            lock=held,
            decode=settings.decode,
        )
    except BaseException:
        if held is not None:
            held.release()
        raise


# =============================================================================================================
# The steps of `prepare`, in order
# =============================================================================================================


def open_run_dir(run_dir, resume, init_from_torch, owner: bool, print_fn) -> tuple[Path, RunLock | None]:
    """The run directory (the resumed one, the given one, or runs/<date-time>) and its lock (held by the owner)."""
    if resume is not None and init_from_torch is not None:
        raise UsageError("--resume and --init-from-torch exclude each other: a resume already has weights")
    if resume is not None and run_dir is not None and Path(run_dir).absolute() != Path(resume).absolute():
        raise UsageError("--resume DIR continues in DIR; leave out --run-dir")
    if resume is None and run_dir is None and jax.process_count() > 1:
        raise UsageError("a multi-process run needs --run-dir: every process must name the same directory")
    run_dir = Path(resume if resume is not None else run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    held = None
    if owner and (resume is None or run_dir.is_dir()):  # a missing --resume folder is reported below
        held = lock_run_dir(run_dir, print_fn)
    try:
        folder = run_dir / ckpt_lib.CHECKPOINT_SUBDIR
        if resume is not None and not folder.is_dir():
            raise ckpt_lib.CheckpointError(
                f"--resume {run_dir}: no {ckpt_lib.CHECKPOINT_SUBDIR}/ folder there; "
                f"give the run directory of an earlier `train.py train`"
            )
        if resume is None and ckpt_lib.committed_steps(folder):
            raise UsageError(
                f"{run_dir} already holds checkpoints: continue it with --resume {run_dir}, or choose another --run-dir"
            )
        if resume is None and owner:  # a start whose first save failed left only a half-written one: start again
            for path in ckpt_lib.discard_partial_saves(folder):
                print_fn(f"removed {path}: the half-written first checkpoint of an earlier start of this run")
    except BaseException:
        if held is not None:
            held.release()
        raise
    return run_dir, held


def inherited_settings(start: ckpt_lib.Checkpoint) -> dict[str, Any]:
    """What a run started from a checkpoint (`--init-from`) takes over from it: how its model decodes."""
    return {"decode": dict(stored_settings(start).get("decode", {}))}


def resume_command(run_dir: Path, parallel: ParallelConfig) -> str:
    """The command that resumes this run, in words (for messages)."""
    command = f"`train.py train --resume {run_dir}"
    if parallel.multi_process and parallel.coordinator is not None:
        n = parallel.num_processes
        return (
            f"{command} --coordinator {parallel.coordinator} --num-processes {n} --process-id I` in each "
            f"process I = 0 .. {n - 1}"
        )
    return command + "`"


@dataclasses.dataclass
class TrainingData:
    """A run's training pairs: files, encoded once into memory-mapped token arrays (`token_arrays`) so that their
    text is never held, or the built-in task's pairs, in memory. `identity`: the files' size, mtime and content
    hash, which a run stores and a resume compares."""

    data: DataConfig
    paths: list[str]
    identity: list[dict[str, Any]]
    corpus: Corpus | None = None  # the built-in task's
    fingerprint: str | None = None  # of the pairs' text, known once encoded

    @classmethod
    def of(cls, data: DataConfig) -> TrainingData:
        if data.uses_default_task:
            return cls(data, [], [], load_corpus(data, "train"))
        paths = [data.tsv] if data.tsv is not None else [data.src, data.tgt]
        PairReader(paths)  # a missing, empty or unreadable file is reported before anything else happens
        return cls(data, paths, [token_arrays.file_identity(p) for p in paths])

    def tokenizer_texts(self, seed: int) -> list[str]:
        """What a new joint tokenizer trains on: both sides of at most `tokenizer_sample` pairs."""
        if self.corpus is not None:
            return self.corpus.sources + self.corpus.targets
        return token_arrays.tokenizer_sample(
            self.paths,
            self.data.tokenizer_sample,
            seed,
            on_empty=self.data.on_empty,
            language_columns=self.data.language_columns,
        )

    def encoded(self, tokenizer, max_len: int, print_fn) -> tuple[EncodedCorpus, str]:
        """The pairs that fit max_len (on disk, for files) and a line describing the corpus; sets `fingerprint`."""
        if self.corpus is not None:
            self.fingerprint = corpus_fingerprint(self.corpus)
            encoded = encode_corpus(self.corpus, tokenizer, max_len, on_too_long=self.data.on_too_long)
            return encoded, self.corpus.describe()
        # Process 0 encodes; the others then map its arrays (or, on a disk of their own, encode them too).
        arrays = distributed.primary_first("encoding the training data", lambda: self._arrays(tokenizer, print_fn))
        if arrays is None:
            arrays = self._arrays(tokenizer, _silent)
        self.fingerprint = arrays.fingerprint
        return arrays.encoded(max_len, self.data.on_too_long, SpecialIds.of(tokenizer)), arrays.describe()

    def _arrays(self, tokenizer, print_fn) -> token_arrays.TokenArrays:
        return token_arrays.open_encoded(
            self.paths,
            tokenizer,
            on_empty=self.data.on_empty,
            language_columns=self.data.language_columns,
            cache_dir=self.data.data_cache,
            identity=self.identity,
            print_fn=print_fn,
            progress=distributed.is_primary(),
        )

    def describe_files(self) -> str:
        return ", ".join(self.paths) or "the built-in numbers task"


def read_corpora(data: DataConfig, stored: Mapping[str, Any] | None, print_fn) -> tuple[TrainingData, Corpus | None]:
    """The training data (its files checked, not read yet) and the validation corpus; a resume whose training
    files hold other bytes than when its checkpoint was written is refused, naming what changed."""
    corpus = TrainingData.of(data)
    before = (stored or {}).get("train_files")
    change = before is not None and token_arrays.describe_change(before, corpus.identity)
    if change:
        raise UsageError(
            f"--resume: the training data changed since the checkpoint was written: {change}; an exact resume "
            f"needs the same data (restore the file, or start a new run from this one's weights with --init-from)"
        )
    valid = load_corpus(data, "valid")
    if valid is not None:
        print_fn(f"validation data: {valid.describe()}")
    else:
        print_fn(
            "no validation data (--valid-src/--valid-tgt or --valid-tsv): no BLEU, the best checkpoint is the last"
        )
    return corpus, valid


def model_and_tokenizer(
    settings: RunSettings, restored, init_from_torch, given_model: dict, given_preset, corpus, run_dir: Path, print_fn
) -> tuple[TransformerConfig, Tokenizer, Any]:
    """The model config, the tokenizer and initial weights (None: initialise): the checkpoint's on a resume (model
    settings given then must describe the saved model), a PyTorch file's, or a new tokenizer and the preset; the
    tokenizer for the languages --src-lang / --tgt-lang name (a multilingual model's; an error for others)."""
    config, tokenizer, params = _model_and_tokenizer(
        settings, restored, init_from_torch, given_model, given_preset, corpus, run_dir, print_fn
    )
    if config.quantize != "none":
        finetuning.check_qlora(config)  # int8 trains only as QLoRA's frozen base
    return config, with_languages(tokenizer, settings.data.src_lang, settings.data.tgt_lang), params


def _model_and_tokenizer(
    settings: RunSettings, restored, init_from_torch, given_model: dict, given_preset, corpus, run_dir: Path, print_fn
) -> tuple[TransformerConfig, Tokenizer, Any]:
    if restored is not None:
        requested = resolution.requested_model(restored.config, given_preset, given_model)
        if "opt_state" not in restored.state:  # weights alone (--init-from): adapters may be added
            if restored.config.lora_rank and _lora(requested) != _lora(restored.config):
                raise ConfigError(
                    f"{restored.directory}: its model has LoRA adapters ({_lora(restored.config)}), which a run "
                    f"starting from it trains on as they are: leave out the --lora-* flags, or merge them first "
                    f"(export --format transformers --merge-lora, then import)"
                )
            adapted = resolution.requested_model(restored.config, None, _lora(requested))  # adapters to add
            restored = dataclasses.replace(restored, config=adapted)
        ckpt_lib.check_config(restored.config, requested, where=f"checkpoint in {run_dir}")
        # The saved model, computed as asked: a bfloat16 run may go on in float32 and back (not bitwise then).
        return resolution.computed(restored.config, requested.compute_settings()), restored.tokenizer, None
    if init_from_torch is not None:
        # Model settings describe the file's model; how to compute (dtype, attention kernel) is this run's choice.
        params, config, tokenizer = _init_from_torch(
            init_from_torch,
            corpus,
            settings.data,
            settings.preset,
            settings.model,
            explicit=any(name not in COMPUTE_FIELDS for name in given_model),
            seed=settings.seed,
            run_dir=run_dir,
            print_fn=print_fn,
        )
        compute = {k: v for k, v in settings.model.items() if k in COMPUTE_FIELDS}
        return resolution.computed(config, compute), tokenizer, params
    if settings.data.language_columns:  # said before a tokenizer trains for minutes
        raise DataError(
            "--language-columns: a model trained from scratch gets a joint SentencePiece tokenizer, which has no "
            "language codes; start from a multilingual model (train.py import NLLB-200, M2M-100 or mBART-50, then "
            "train --init-from RUN)"
        )
    tokenizer = shared_tokenizer(corpus, settings.data, settings.seed, run_dir, print_fn)
    return resolution.model_config(settings.preset, tokenizer.vocab_size, settings.model), tokenizer, None


def _lora(config: TransformerConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in LORA_FIELDS}


def batches(settings: RunSettings, config, tokenizer, corpus, valid_corpus, devices, restored, stored, print_fn):
    """The training stream (its global batch plan, the same on any number of devices; positioned where a resumed
    run stopped; in a multi-process run each process reads only its rows) and the validation set."""
    data = settings.data
    encoded, described = corpus.encoded(tokenizer, config.max_len, print_fn)
    print_fn(f"training data: {described}")
    if stored is not None and stored.get("train_fingerprint") not in (None, corpus.fingerprint):
        raise UsageError(
            f"--resume: the training data changed since the checkpoint was written ({corpus.describe_files()}); an "
            f"exact resume needs the same data"
        )
    print_fn(f"training data: {encoded.describe()}")
    sharded = devices.mode == "sharded" and jax.process_count() > 1
    stream = BatchStream(
        encoded,
        data.max_tokens,
        batching=data.batching,
        pack_length=data.pack_length,
        row_multiple=data.row_multiple,
        seed=settings.seed,
        state=None if restored is None else restored.data_state,
        process_rows=devices.process_rows if sharded else None,
    )
    for rows, length in stream.shapes:
        devices.check_rows(
            rows, f"a batch of length {length} (--max-tokens {data.max_tokens}, --row-multiple {data.row_multiple})"
        )
    if valid_corpus is None:
        return stream, None
    valid_encoded = encode_corpus(valid_corpus, tokenizer, config.max_len, on_too_long=data.on_too_long)
    print_fn(f"validation data: {valid_encoded.describe()}")
    return stream, ValidationSet.from_encoded(valid_encoded, valid_corpus, data.max_tokens, batching=data.batching)


def initial_state(restored, config: TransformerConfig, settings: RunSettings, params) -> TrainState:
    if restored is None:
        return create_train_state(config, settings.optim, seed=settings.seed, params=params)
    try:
        return restore_train_state(restored.state, config, settings.optim)
    except ValueError as e:
        raise ckpt_lib.CheckpointError(f"{restored.directory} step {restored.step}: {e}") from None


def imported_from(checkpoint) -> dict[str, Any] | None:
    """The pretrained model a run's weights came from ({"source", "family"}: `train.py import`), kept by every run
    that resumes or starts from it, so that `export --format transformers` writes the family it came from."""
    return None if checkpoint is None else stored_settings(checkpoint).get("imported_from")


def run_settings(settings: RunSettings, corpus: TrainingData, devices, origin: dict | None = None) -> dict[str, Any]:
    """What every checkpoint stores as the run's settings (with the config, optimiser and tokenizer apart)."""
    return {
        **({"imported_from": origin} if origin else {}),
        "preset": settings.preset,
        "recipe": settings.recipe,
        "seed": settings.seed,
        "data": settings.data.absolute().to_dict(),
        "loop": settings.loop.to_dict(),
        "decode": settings.decode.to_dict(),
        "train_fingerprint": corpus.fingerprint,
        "train_files": corpus.identity or None,  # each file's size, mtime and content hash: a resume names a change
        "devices": devices.n_devices,  # for information: a resume may use another count
        "processes": jax.process_count(),
    }


def agree_and_write(stored: Mapping[str, Any], config, settings: RunSettings, tokenizer, run_dir: Path, restored):
    """Every process must have the same settings, data and tokenizer (this is also the barrier after which process
    0 writes into the run directory that the others have checked); then process 0 writes tokenizer.model and
    config.json, and on a resume drops the metrics of the steps it trains again."""
    parallel = {**settings.parallel.to_dict(), "process_id": None}
    mine = [stored, config.to_dict(), settings.optim.to_dict(), parallel]
    distributed.all_same(
        "settings, data or tokenizer", json.dumps(mine, sort_keys=True).encode() + tokenizer.to_bytes()
    )
    if distributed.is_primary():
        run_dir.mkdir(parents=True, exist_ok=True)
        tokenizer.save(run_dir / "tokenizer.model")
        files.write_text(run_dir / "config.json", config.to_json() + "\n")
        # A resume trains again the steps after its checkpoint; a new start drops every record of an earlier start.
        truncate_metrics(run_dir / "metrics.jsonl", -1 if restored is None else restored.step)


# =============================================================================================================
# The run directory: its lock, and what a resume restores
# =============================================================================================================

LOCK_FILE = "train.lock"


@dataclasses.dataclass
class RunLock:
    """A held run-directory lock: an exclusive `fcntl.flock` on `<run>/train.lock`, which the operating system
    releases when the process ends in any way (kill -9 included), so a lock can never be left stale. The file
    holds the holder's pid, host, start time and command, for the message another run gets."""

    path: Path
    file: Any
    created_dir: bool  # the run directory was made for this run (removed again if nothing else was written)

    def release(self) -> None:
        if self.file is None:
            return
        self.file.seek(0)
        self.file.truncate()  # empty: released cleanly, so the next run has no stale holder to report
        import fcntl

        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()
        self.file = None
        run_dir = self.path.parent
        if self.created_dir and [p.name for p in run_dir.iterdir()] == [LOCK_FILE]:
            self.path.unlink()
            run_dir.rmdir()


def _describe_holder(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}: {holder['command']}"
    except (ValueError, KeyError, TypeError):
        return f"lock file content {text[:200]!r}"


def lock_run_dir(run_dir: str | os.PathLike, print_fn: Callable[[str], None] = print) -> RunLock:
    """Takes the lock of a run directory (created if needed) or raises UsageError naming the training that
    holds it. A lock file left by a killed training is taken over, with a warning naming it.

    Written by hand because no library here does it: `fcntl.flock` is the OS primitive (per open file, gone
    with its process); pid files alone would need a liveness guess. On network file systems whose flock is
    local to each machine, a training on another machine is not seen.
    """
    import fcntl

    run_dir = Path(run_dir)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    file = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (held open for the run: the lock lives with it)
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = _describe_holder(file.read().strip())
        file.close()
        raise UsageError(
            f"{run_dir} is in use by another training ({holder}); two trainings writing one run directory "
            f"would mix their checkpoints. Wait for it to end or stop it, or choose another --run-dir"
        ) from None
    file.seek(0)
    previous = file.read().strip()
    if previous:  # the last holder did not release it: it was killed (or crashed)
        print_fn(f"warning: {run_dir}: taking over the lock left by {_describe_holder(previous)}, which has ended")
    file.seek(0)
    file.truncate()
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
    }
    file.write(json.dumps(holder) + "\n")
    file.flush()
    return RunLock(path, file, created)


def restore_for_resume(
    run_dir: Path,
    *,
    strict: bool = False,
    owner: bool = True,
    print_fn: Callable[[str], None] = print,
    placement: ckpt_lib.Placement | None = None,
) -> ckpt_lib.Checkpoint:
    """The checkpoint a resume continues from: the newest one that verifies. Half-written saves (a kill or a
    failed save) are removed and damaged newer steps moved to `checkpoints-damaged/`, each with a warning
    (only by the lock's `owner`); with `strict`, a damaged newest step is a CheckpointError instead."""
    folder = run_dir / ckpt_lib.CHECKPOINT_SUBDIR
    partial = ckpt_lib.discard_partial_saves(folder) if owner else []
    for path in partial:
        print_fn(f"warning: removed {path}: a save interrupted before it completed (never a checkpoint)")
    # In a multi-process run every process reads the checkpoints in the same order (orbax synchronises the
    # processes as it opens them), after the owner's clean-up and before it moves damaged steps aside.
    distributed.barrier("resume: half-written saves removed")
    if not ckpt_lib.committed_steps(folder):
        raise ckpt_lib.CheckpointError(
            f"--resume {run_dir}: no checkpoint of this run is complete, so there is nothing to resume: start it "
            f"again with the command that started it (--run-dir {run_dir}, without --resume)"
        )
    restored, damaged = ckpt_lib.newest_intact(run_dir, strict=strict, placement=placement)
    for step, error in damaged:
        where = ckpt_lib.quarantine(folder, step) if owner else None
        print_fn(f"warning: {error}" + (f"; moved to {where}" if where else ""))
    distributed.barrier("resume: damaged steps moved aside")
    if damaged:
        print_fn(
            f"warning: resuming from step {restored.step}, the newest intact checkpoint (pass --strict-resume to "
            f"refuse instead); the steps after it are trained again"
        )
    if "averaged_from" in restored.run:
        raise UsageError(
            f"--resume {run_dir}: this is an average of checkpoints ({restored.run['averaged_from']}): it holds "
            f"parameters only, no optimiser state or data position, so it cannot continue a run. Use it with "
            f"evaluate/translate/export; resume the original run directory instead"
        )
    if not restored.verified:
        print_fn(
            f"note: step {restored.step} is a format-{restored.format} checkpoint, written before checksums: "
            f"loaded without verifying its arrays"
        )
    print_fn(f"resuming {run_dir} from step {restored.step}")
    return restored


# =============================================================================================================
# The pieces
# =============================================================================================================


def train_tokenizer(
    corpus: TrainingData, data: DataConfig, seed: int, print_fn: Callable[[str], None] = print
) -> Tokenizer:
    """The joint SentencePiece model of a run, trained on both sides of (a sample of) the training corpus."""
    texts = corpus.tokenizer_texts(seed)
    print_fn(
        f"training a joint {data.tokenizer_type} SentencePiece tokenizer (vocabulary up to {data.vocab_size}) "
        f"on {len(texts) // 2} pairs (--tokenizer-sample {data.tokenizer_sample}) ..."
    )
    return Tokenizer.train(texts, data.vocab_size, model_type=data.tokenizer_type)


def shared_tokenizer(
    corpus: TrainingData, data: DataConfig, seed: int, run_dir: Path, print_fn: Callable[[str], None] = print
) -> Tokenizer:
    """`train_tokenizer`, trained once: in a multi-process run process 0 trains it and writes
    <run>/tokenizer.model, the others wait for it (`distributed.primary_first`: an error there stops them too) and
    read that file (so the run directory must be shared)."""
    if jax.process_count() == 1:
        return train_tokenizer(corpus, data, seed, print_fn)
    path = run_dir / "tokenizer.model"

    def train_and_write() -> Tokenizer:
        tokenizer = train_tokenizer(corpus, data, seed, print_fn)
        run_dir.mkdir(parents=True, exist_ok=True)
        tokenizer.save(path)
        return tokenizer

    tokenizer = distributed.primary_first("training the tokenizer", train_and_write)
    if tokenizer is not None:
        return tokenizer
    if not path.is_file():
        raise UsageError(
            f"process {jax.process_index()} cannot see {path.absolute()}, which process 0 has written: every process "
            f"needs the same run directory (a shared filesystem), as orbax's checkpoints do"
        )
    return Tokenizer.load(path)


def _silent(text: str = "") -> None:
    """The print function of processes other than process 0."""


def _init_from_torch(
    path,
    corpus: TrainingData,
    data: DataConfig,
    preset_name: str,
    model_fields: Mapping[str, Any],
    *,
    explicit: bool,
    seed: int,
    run_dir: Path,
    print_fn,
) -> tuple[Any, TransformerConfig, Tokenizer]:
    """Weights, config and tokenizer for --init-from-torch. Model settings given explicitly describe (or must
    agree with) the model in the file; the file's own tokenizer wins over a freshly trained one."""
    from jax_transformer.interop.export import import_weights

    tokenizer = requested = None
    if explicit:
        tokenizer = shared_tokenizer(corpus, data, seed, run_dir, print_fn)
        requested = resolution.model_config(preset_name, tokenizer.vocab_size, model_fields)
    params, config, file_tokenizer = import_weights(path, requested)
    if file_tokenizer is not None:
        tokenizer = file_tokenizer  # the vocabulary the weights were trained with
    elif tokenizer is None:
        tokenizer = shared_tokenizer(corpus, data, seed, run_dir, print_fn)
    if tokenizer.vocab_size != config.src_vocab_size or tokenizer.vocab_size != config.tgt_vocab_size:
        raise ckpt_lib.CheckpointError(
            f"--init-from-torch {path}: the model's vocabulary (src_vocab_size {config.src_vocab_size}, "
            f"tgt_vocab_size {config.tgt_vocab_size}) does not match the tokenizer's {tokenizer.vocab_size} pieces; "
            f"the file carries no tokenizer, so pass --vocab-size to match"
        )
    print_fn(f"initialised from PyTorch weights {path}")
    return params, config, tokenizer


def _describe_batches(stream: BatchStream) -> str:
    share = f"{100 * stream.padding_efficiency:.0f}% of slots real"
    if stream.batching == "packed":
        rows, length = stream.shapes[0]
        return (
            f"packed batches of {rows} rows x {length} = {rows * length} token slots, "
            f"{stream.batches_per_epoch} per epoch, one shape ({share})"
        )
    return (
        f"bucketed batches of ~{stream.shapes[0][0] * stream.shapes[0][1]} token slots, {stream.batches_per_epoch} "
        f"per epoch, {len(stream.shapes)} shapes ({share})"
    )
