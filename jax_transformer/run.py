"""Setting up and running a training run: the one function `train.py train` calls, usable from Python as well.

    from jax_transformer import run
    result = run.train(run_dir="runs/de-en", preset="small",
                       data={"src": "train.de", "tgt": "train.en", "valid_src": "val.de", "valid_tgt": "val.en"},
                       optim={"warmup_steps": 300, "lr_scale": 0.5}, loop={"steps": 4000, "max_minutes": 50})
    result = run.train(resume="runs/de-en", loop={"steps": 8000})          # continue it, exactly

Settings come in five groups, each the fields of one dataclass: `model` (`TransformerConfig`), `data`
(`DataConfig`), `optim` (`OptimConfig`), `loop` (`LoopConfig`) and `parallel` (`ParallelConfig`); `train.py`'s
flags are those field names. A group given as a partial dict is completed from, in this order of precedence:
what is given; on a resume, what the checkpoint stored; the recipe (`RECIPES`: a measured set of settings by
name, `--recipe NAME`; by default `DEFAULT_RECIPE` of the task: "numbers" for the built-in numbers task, whose
small defaults are `NUMBERS_TASK_DEFAULTS`); the dataclass defaults. `parallel` describes the machine, not the
run, and is never restored: a resume may use other devices.

A multi-process run (`parallel` with a coordinator, see `jax_transformer.distributed`) calls `prepare` in every
process with the same settings: all read and encode the data, process 0 alone trains the tokenizer and writes
the run directory's files (the others wait for the tokenizer at a barrier and read it), and the processes check
that they agree on every setting before training.

`prepare` follows the data one way: read the corpus -> train (or restore) the tokenizer -> build (or restore,
or import from PyTorch) the model config and weights -> encode and batch -> a `Trainer` ready to run. A resume
checks that nothing an exact continuation depends on has changed (data, tokenizer, optimiser, seed, model) and
names the setting that did.

Faults: a run holds a lock on its directory (`lock_run_dir`), so a second training there refuses to start; a
resume restores the newest checkpoint that verifies (`checkpoint.newest_intact`), moving damaged newer ones
aside with a warning (or refusing, with strict_resume), and removes half-written saves left by a kill.
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

from jax_transformer import checkpoint as ckpt_lib
from jax_transformer import compilation, distributed
from jax_transformer.config import (
    COMPUTE_FIELDS,
    PRESETS,
    ConfigError,
    OptimConfig,
    TransformerConfig,
    preset,
)
from jax_transformer.data import (
    BatchStream,
    Corpus,
    DataConfig,
    DataError,
    Tokenizer,
    corpus_fingerprint,
    encode_corpus,
    load_corpus,
)
from jax_transformer.trainer import (
    LoopConfig,
    RunResult,
    Trainer,
    ValidationSet,
    truncate_metrics,
)
from jax_transformer.training import TrainState, create_train_state, restore_train_state

GROUPS = ("model", "data", "optim", "loop", "parallel")

# The built-in numbers task: sized to reach a useful model on 2 CPU cores in about two minutes (README).
NUMBERS_TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "model": {"max_len": 32},
    "data": {"vocab_size": 256, "tokenizer_type": "bpe", "max_tokens": 2048},
    "optim": {"lr_scale": 2.0, "warmup_steps": 400},
    "loop": {"steps": 1000, "eval_every": 500, "save_every": 500},
}
DEFAULT_PRESET = {"numbers": "tiny", "files": "small"}

# Named recipes: the settings of a measured training command, by name (`train.py train --recipe NAME`). A recipe
# fills each group below what is given; "preset" is the model preset it starts from. A JSON file of the same form
# is a recipe too (`--recipe my-recipe.json`: {"about": ..., "preset": ..., "model": {...}, "data": {...},
# "optim": {...}, "loop": {...}}, every key optional). To make a recipe the default for data files, name it in
# DEFAULT_RECIPE["files"].
RECIPES: dict[str, dict[str, Any]] = {
    "numbers": {
        "about": "the built-in numbers task's defaults (tiny model, ~2 minutes on 2 CPU cores)",
        "preset": "tiny",
        **NUMBERS_TASK_DEFAULTS,
    },
    "multi30k": {
        "about": "Multi30k de->en for a GPU: small preset, joint 6000-piece vocabulary, ~4096-token batches, "
        "warmup 300, lr scale 0.5, clip 1.0, 50 minutes, greedy BLEU on 200 sentences every 500 steps (41.4 BLEU "
        "on an H100 within 3000 steps)",
        "preset": "small",
        "model": {},
        "data": {"vocab_size": 6000, "max_tokens": 4096},
        "optim": {"warmup_steps": 300, "lr_scale": 0.5, "clip_norm": 1.0},
        "loop": {
            "steps": 100000,
            "max_minutes": 50.0,
            "eval_every": 500,
            "save_every": 250,
            "eval_sentences": 200,
            "eval_beam_size": 1,
            "beam_size": 4,
        },
    },
    "multi30k-cpu": {
        "about": "Multi30k de->en in 60 minutes on 2 CPU cores (38.7 BLEU, README): small preset with d_ff 512, "
        "2048-token batches, warmup 300, lr scale 0.5, clip 1.0, 56 minutes of training, greedy BLEU on 200 "
        "sentences every 250 steps, beam 4 on all sentences at the end",
        "preset": "small",
        "model": {"d_ff": 512},
        "data": {"vocab_size": 6000, "max_tokens": 2048},
        "optim": {"warmup_steps": 300, "lr_scale": 0.5, "clip_norm": 1.0},
        "loop": {
            "steps": 100000,
            "max_minutes": 56.0,
            "eval_every": 250,
            "save_every": 250,
            "eval_sentences": 200,
            "eval_beam_size": 1,
            "beam_size": 4,
        },
    },
}
# The recipe a run gets when none is named: the numbers task's own; for data files none (the dataclass defaults
# and the small preset): the measured recipes stop after a fixed number of minutes, which a run on other data
# should not inherit without asking for it (`--recipe multi30k-cpu`).
DEFAULT_RECIPE: dict[str, str | None] = {"numbers": "numbers", "files": None}

# What an exact resume needs unchanged (validation files, the loop's budgets and the decoding may change).
FROZEN_DATA_FIELDS = (
    "src",
    "tgt",
    "tsv",
    "vocab_size",
    "tokenizer_type",
    "max_tokens",
    "row_multiple",
    "batching",
    "pack_length",
    "on_empty",
    "on_too_long",
)


class UsageError(ValueError):
    """Settings that do not fit together (e.g. a resume asked to change what an exact resume needs unchanged)."""


@dataclasses.dataclass
class PreparedRun:
    """Everything `prepare` built. `trainer.run()` trains; `checkpoints.close()` must follow (as `train` does)."""

    trainer: Trainer
    checkpoints: ckpt_lib.CheckpointManager
    config: TransformerConfig
    tokenizer: Tokenizer
    run_dir: Path
    settings: dict[str, Any]  # what the checkpoints store as the run's settings (see `_stored_settings`)
    lock: RunLock | None = None  # the run directory's lock, released by `train` at the end

    def close(self) -> None:
        """Waits for the last save and releases the run directory."""
        try:
            self.checkpoints.close()
        finally:
            if self.lock is not None:
                self.lock.release()


def train(*, print_fn: Callable[[str], None] = print, **settings: Any) -> RunResult:
    """Prepares a run (see `prepare` for the arguments), trains it to its end and closes its checkpoints."""
    prepared = prepare(print_fn=print_fn, **settings)
    try:
        result = prepared.trainer.run()
    finally:
        prepared.close()
    return dataclasses.replace(
        result, checkpoint_dir=prepared.checkpoints.directory, best_step=prepared.checkpoints.best_step()
    )


def prepare(
    *,
    run_dir: str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    strict_resume: bool = False,
    lock: bool = True,
    print_fn: Callable[[str], None] = print,
    **settings: Any,
) -> PreparedRun:
    """Sets up a training run and returns it ready to run.

    run_dir: where checkpoints, metrics.jsonl, loss_curve.png, tokenizer.model and config.json go (default
      runs/<date-time>); resume: continue the run in this directory from its newest intact checkpoint (no
      run_dir); strict_resume: refuse to resume when the newest checkpoint is damaged, instead of falling back;
    lock: hold the run directory's lock (`lock_run_dir`) until the run ends; in a multi-process run process 0
      alone takes it, and alone tidies the checkpoint folder on a resume;
    init_from_torch: start from the weights of a PyTorch file (`jax_transformer.export`);
    preset_name: "tiny", "small" or "base" (default: the recipe's, else tiny for the numbers task, small for files);
    seed: of initialisation, dropout and data order (default 0);
    model / data / optim / loop / parallel: partial dicts of TransformerConfig / DataConfig / OptimConfig /
      LoopConfig / ParallelConfig fields (`distributed.ParallelConfig`: how many devices and processes);
    recipe: a name in RECIPES, or a recipe JSON file, whose settings fill what is not given (default:
      DEFAULT_RECIPE of the task); a resume keeps the settings it stored.
    """
    # First the processes join (before anything starts JAX's backends); from here on only process 0 prints.
    parallel = distributed.ParallelConfig.from_dict(dict(settings.pop("parallel", None) or {}))
    distributed.initialize(parallel, print_fn)
    owner = lock and distributed.is_primary()
    if not distributed.is_primary():
        print_fn = _silent
    if resume is None:
        if run_dir is None and jax.process_count() > 1:
            raise UsageError("a multi-process run needs --run-dir: every process must name the same directory")
        run_dir = Path(run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    held = None
    if owner and (resume is None or Path(resume).is_dir()):  # a missing --resume folder is reported below
        held = lock_run_dir(run_dir if resume is None else resume, print_fn)
    try:
        prepared = _prepare(
            run_dir=run_dir,
            resume=resume,
            strict_resume=strict_resume,
            owner=owner,
            parallel=parallel.to_dict(),
            print_fn=print_fn,
            **settings,
        )
    except BaseException:
        if held is not None:
            held.release()
        raise
    prepared.lock = held
    return prepared


def _prepare(
    *,
    run_dir: str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    strict_resume: bool = False,
    owner: bool = True,
    init_from_torch: str | os.PathLike | None = None,
    preset_name: str | None = None,
    seed: int | None = None,
    model: Mapping[str, Any] | None = None,
    data: Mapping[str, Any] | None = None,
    optim: Mapping[str, Any] | None = None,
    loop: Mapping[str, Any] | None = None,
    parallel: Mapping[str, Any] | None = None,
    recipe: str | None = None,
    start_time: float | None = None,
    print_fn: Callable[[str], None] = print,
) -> PreparedRun:
    """`prepare` once the processes have joined and the run directory is locked; `owner`: this process holds the
    lock (process 0 of a multi-process run), so it alone tidies the checkpoint folder on a resume."""
    start_time = time.time() if start_time is None else start_time
    given = {"model": dict(model or {}), "data": dict(data or {}), "optim": dict(optim or {}), "loop": dict(loop or {})}
    parallel_config = distributed.ParallelConfig.from_dict(dict(parallel or {}))
    if resume is not None and init_from_torch is not None:
        raise UsageError("--resume and --init-from-torch exclude each other: a resume already has weights")
    if resume is not None and run_dir is not None and Path(run_dir).absolute() != Path(resume).absolute():
        raise UsageError("--resume DIR continues in DIR; leave out --run-dir")

    # --- where the run lives, and what a resume restores ------------------------------------------------------
    restored, stored = None, None
    if resume is not None:
        run_dir = Path(resume)
        if not (run_dir / ckpt_lib.CHECKPOINT_SUBDIR).is_dir():
            raise ckpt_lib.CheckpointError(
                f"--resume {run_dir}: no {ckpt_lib.CHECKPOINT_SUBDIR}/ folder there; "
                f"give the run directory of an earlier `train.py train`"
            )
        restored = restore_for_resume(run_dir, strict=strict_resume, owner=owner, print_fn=print_fn)
        if "averaged_from" in restored.run:
            raise UsageError(
                f"--resume {run_dir}: this is an average of checkpoints ({restored.run['averaged_from']}): it holds "
                f"parameters only, no optimiser state or data position, so it cannot continue a run. Use it with "
                f"evaluate/translate/export; resume the original run directory instead"
            )
        stored = stored_settings(restored)
        print_fn(f"resuming {run_dir} from step {restored.step}")
    else:
        run_dir = Path(run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        folder = run_dir / ckpt_lib.CHECKPOINT_SUBDIR
        if folder.is_dir() and any(folder.iterdir()):
            raise UsageError(
                f"{run_dir} already holds checkpoints: continue it with --resume {run_dir}, or choose another --run-dir"
            )

    # --- settings: given, else stored, else the recipe's ------------------------------------------------------------
    recipe_name = _choose_recipe(recipe, given["data"], stored)
    # A resume has every setting stored already; a fresh run takes what is not given from its recipe.
    recipe_settings = load_recipe(recipe_name) if recipe_name and stored is None else {}
    recipe_defaults = {group: dict(recipe_settings.get(group, {})) for group in GROUPS}
    data_config = _resolve_data(given["data"], stored, recipe_defaults["data"])
    task = "numbers" if data_config.uses_default_task else "files"
    if stored is not None:
        _check_frozen("seed", seed, stored["seed"])
        for name, value in given["optim"].items():
            _check_frozen(name, value, stored["optim"].get(name))
        # The best checkpoint so far and early stopping's best score were chosen by the stored metric.
        _check_frozen("best_metric", given["loop"].get("best_metric"), stored["loop"].get("best_metric", "bleu"))
    seed = stored["seed"] if stored is not None else (0 if seed is None else seed)
    optim_config = OptimConfig.from_dict(
        {**recipe_defaults["optim"], **(stored or {}).get("optim", {}), **given["optim"]}, source="optimiser settings"
    )
    loop_config = LoopConfig.from_dict(
        {**recipe_defaults["loop"], **(stored or {}).get("loop", {}), **given["loop"]}, source="loop settings"
    )

    # --- data ---------------------------------------------------------------------------------------------------
    train_corpus = load_corpus(data_config, "train")
    print_fn(f"training data: {train_corpus.describe()}")
    fingerprint = corpus_fingerprint(train_corpus)
    if stored is not None and stored.get("train_fingerprint") not in (None, fingerprint):
        raise UsageError(
            f"--resume: the training data changed since the checkpoint was written "
            f"({_describe_files(data_config)}); an exact resume needs the same data"
        )
    valid_corpus = load_corpus(data_config, "valid")
    if valid_corpus is not None:
        print_fn(f"validation data: {valid_corpus.describe()}")
    else:
        print_fn(
            "no validation data (--valid-src/--valid-tgt or --valid-tsv): no BLEU, the best checkpoint is the last"
        )

    # --- tokenizer, model config and initial weights --------------------------------------------------------------
    explicit_preset = preset_name
    recipe_preset = recipe_settings.get("preset")
    preset_name = preset_name or (stored or {}).get("preset") or recipe_preset or DEFAULT_PRESET[task]
    if preset_name not in PRESETS:
        raise ConfigError(f"unknown preset {preset_name!r}; choose one of {sorted(PRESETS)}")
    model_fields = {**recipe_defaults["model"], **given["model"]}
    params = None
    if restored is not None:
        tokenizer = restored.tokenizer
        # Model settings given on a resume must describe the saved model: any difference is named.
        changes = {**(PRESETS[explicit_preset] if explicit_preset else {}), **given["model"]}
        requested = restored.config.replace(**changes) if changes else restored.config
        ckpt_lib.check_config(restored.config, requested, where=f"checkpoint in {run_dir}")
        # The saved model, computed as asked: a bfloat16 run may go on in float32 and back (not bitwise then).
        config = restored.config.replace(**requested.compute_settings())
    elif init_from_torch is not None:
        # Model settings describe the file's model; how to compute (dtype, attention kernel) is this run's choice.
        compute = {k: v for k, v in model_fields.items() if k in COMPUTE_FIELDS}
        params, config, tokenizer = _init_from_torch(
            init_from_torch,
            train_corpus,
            data_config,
            preset_name,
            model_fields,
            explicit=any(name not in COMPUTE_FIELDS for name in given["model"]),
            run_dir=run_dir,
            print_fn=print_fn,
        )
        config = config.replace(**compute)
    else:
        tokenizer = shared_tokenizer(train_corpus, data_config, run_dir, print_fn)
        config = model_config(preset_name, tokenizer.vocab_size, model_fields)

    # --- batches: the global batch plan, the same on any number of devices ---------------------------------------
    cache_dir = compilation.use_cache(loop_config.compilation_cache, print_fn)  # before the model's programs compile
    devices = distributed.DataParallel.from_config(parallel_config)
    encoded = encode_corpus(train_corpus, tokenizer, config.max_len, on_too_long=data_config.on_too_long)
    print_fn(f"training data: {encoded.describe()}")
    stream = BatchStream(
        encoded,
        data_config.max_tokens,
        batching=data_config.batching,
        pack_length=data_config.pack_length,
        row_multiple=data_config.row_multiple,
        seed=seed,
        state=None if restored is None else restored.data_state,
    )
    for rows, length in stream.shapes:
        devices.check_rows(
            rows,
            f"a batch of length {length} (--max-tokens {data_config.max_tokens}, "
            f"--row-multiple {data_config.row_multiple})",
        )
    valid = None
    if valid_corpus is not None:
        valid_encoded = encode_corpus(valid_corpus, tokenizer, config.max_len, on_too_long=data_config.on_too_long)
        print_fn(f"validation data: {valid_encoded.describe()}")
        valid = ValidationSet.from_encoded(
            valid_encoded, valid_corpus, data_config.max_tokens, batching=data_config.batching
        )

    # --- state ------------------------------------------------------------------------------------------------
    state = _initial_state(restored, config, optim_config, seed, params)
    settings = {
        "preset": preset_name,
        "recipe": recipe_name,
        "seed": seed,
        "data": data_config.absolute().to_dict(),
        "loop": loop_config.to_dict(),
        "train_fingerprint": fingerprint,
        "devices": devices.n_devices,  # for information: a resume may use another count
        "processes": jax.process_count(),
    }
    # Every process must have the same settings, data and tokenizer (this is also the barrier after which
    # process 0 writes into the run directory that the others have checked).
    distributed.all_same(
        "settings, data or tokenizer",
        json.dumps(
            [settings, config.to_dict(), optim_config.to_dict(), {**parallel_config.to_dict(), "process_id": None}],
            sort_keys=True,
        ).encode()
        + tokenizer.to_bytes(),
    )
    manager = ckpt_lib.CheckpointManager(run_dir / ckpt_lib.CHECKPOINT_SUBDIR, keep=loop_config.keep)
    if distributed.is_primary():
        run_dir.mkdir(parents=True, exist_ok=True)
        tokenizer.save(run_dir / "tokenizer.model")
        (run_dir / "config.json").write_text(config.to_json() + "\n", encoding="utf-8")
        if restored is not None:
            truncate_metrics(run_dir / "metrics.jsonl", restored.step)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    print_fn(
        f"model: {n_params:,} parameters, d_model {config.d_model}, {config.num_encoder_layers}+"
        f"{config.num_decoder_layers} layers, vocabulary {config.src_vocab_size}; {devices.describe()}; "
        f"{_describe_batches(stream)}; run directory {run_dir}; compilation cache {cache_dir or 'off'}"
    )
    trainer = Trainer(
        config=config,
        optim=optim_config,
        tokenizer=tokenizer,
        stream=stream,
        state=state,
        loop=loop_config,
        run_dir=run_dir,
        checkpoints=manager,
        valid=valid,
        run_settings=settings,
        parallel=devices,
        start_time=start_time,
        print_fn=print_fn,
        loop_state=None if restored is None else restored.loop_state,
    )
    return PreparedRun(trainer, manager, config, tokenizer, run_dir, settings)


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
    run_dir: Path, *, strict: bool = False, owner: bool = True, print_fn: Callable[[str], None] = print
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
    restored, damaged = ckpt_lib.newest_intact(run_dir, strict=strict)
    for step, error in damaged:
        where = ckpt_lib.quarantine(folder, step) if owner else None
        print_fn(f"warning: {error}" + (f"; moved to {where}" if where else ""))
    distributed.barrier("resume: damaged steps moved aside")
    if damaged:
        print_fn(
            f"warning: resuming from step {restored.step}, the newest intact checkpoint (pass --strict-resume to "
            f"refuse instead); the steps after it are trained again"
        )
    if not restored.verified:
        print_fn(
            f"note: step {restored.step} is a format-{restored.format} checkpoint, written before checksums: "
            f"loaded without verifying its arrays"
        )
    return restored


# =============================================================================================================
# The pieces
# =============================================================================================================


def model_config(preset_name: str, vocab_size: int, fields: Mapping[str, Any]) -> TransformerConfig:
    """A preset with the tokenizer's vocabulary on both sides and the given fields applied. Source and target
    share one SentencePiece vocabulary here, so the embedding table is shared unless a field says otherwise."""
    base = dict(src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, share_embeddings=True)
    return preset(preset_name, **{**base, **fields})


def train_tokenizer(corpus: Corpus, data: DataConfig, print_fn: Callable[[str], None] = print) -> Tokenizer:
    """The joint SentencePiece model of a run, trained on both sides of the training corpus."""
    print_fn(
        f"training a joint {data.tokenizer_type} SentencePiece tokenizer (vocabulary up to {data.vocab_size}) "
        f"on {len(corpus)} pairs ..."
    )
    return Tokenizer.train(corpus.sources + corpus.targets, data.vocab_size, model_type=data.tokenizer_type)


def shared_tokenizer(
    corpus: Corpus, data: DataConfig, run_dir: Path, print_fn: Callable[[str], None] = print
) -> Tokenizer:
    """`train_tokenizer`, trained once: in a multi-process run process 0 trains it and writes
    <run>/tokenizer.model, the others wait at a barrier and read that file (so the run directory must be shared)."""
    if jax.process_count() == 1:
        return train_tokenizer(corpus, data, print_fn)
    path = run_dir / "tokenizer.model"
    if distributed.is_primary():
        tokenizer = train_tokenizer(corpus, data, print_fn)
        run_dir.mkdir(parents=True, exist_ok=True)
        tokenizer.save(path)
    distributed.barrier("tokenizer written")
    if distributed.is_primary():
        return tokenizer
    if not path.is_file():
        raise UsageError(
            f"process {jax.process_index()} cannot see {path.absolute()}, which process 0 has written: every process "
            f"needs the same run directory (a shared filesystem), as orbax's checkpoints do"
        )
    return Tokenizer.load(path)


def _silent(text: str = "") -> None:
    """The print function of processes other than process 0."""


def _initial_state(restored, config: TransformerConfig, optim: OptimConfig, seed: int, params) -> TrainState:
    if restored is None:
        return create_train_state(config, optim, seed=seed, params=params)
    try:
        return restore_train_state(restored.state, config, optim)
    except ValueError as e:
        raise ckpt_lib.CheckpointError(f"{restored.directory} step {restored.step}: {e}") from None


def _init_from_torch(
    path,
    corpus: Corpus,
    data: DataConfig,
    preset_name: str,
    model_fields: Mapping[str, Any],
    *,
    explicit: bool,
    run_dir: Path,
    print_fn,
) -> tuple[Any, TransformerConfig, Tokenizer]:
    """Weights, config and tokenizer for --init-from-torch. Model settings given explicitly describe (or must
    agree with) the model in the file; the file's own tokenizer wins over a freshly trained one."""
    from jax_transformer.export import import_weights

    tokenizer = requested = None
    if explicit:
        tokenizer = shared_tokenizer(corpus, data, run_dir, print_fn)
        requested = model_config(preset_name, tokenizer.vocab_size, model_fields)
    params, config, file_tokenizer = import_weights(path, requested)
    if file_tokenizer is not None:
        tokenizer = file_tokenizer  # the vocabulary the weights were trained with
    elif tokenizer is None:
        tokenizer = shared_tokenizer(corpus, data, run_dir, print_fn)
    if tokenizer.vocab_size != config.src_vocab_size or tokenizer.vocab_size != config.tgt_vocab_size:
        raise ckpt_lib.CheckpointError(
            f"--init-from-torch {path}: the model's vocabulary (src_vocab_size {config.src_vocab_size}, "
            f"tgt_vocab_size {config.tgt_vocab_size}) does not match the tokenizer's {tokenizer.vocab_size} pieces; "
            f"the file carries no tokenizer, so pass --vocab-size to match"
        )
    print_fn(f"initialised from PyTorch weights {path}")
    return params, config, tokenizer


def load_recipe(name: str) -> dict[str, Any]:
    """RECIPES[name], or the recipe in the JSON file `name` (see RECIPES), checked: ConfigError naming the file
    and the group for unknown keys or fields, or values the settings refuse."""
    if name in RECIPES:
        return RECIPES[name]
    path = Path(name)
    if not path.is_file():
        raise ConfigError(f"unknown recipe {name!r}: neither one of {sorted(RECIPES)} nor a recipe JSON file")
    try:
        recipe = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"recipe {path}: cannot read it as JSON: {e}") from None
    known = {"about", "preset", *GROUPS}
    if not isinstance(recipe, dict) or set(recipe) - known:
        unknown = sorted(set(recipe) - known) if isinstance(recipe, dict) else type(recipe).__name__
        raise ConfigError(f"recipe {path}: a JSON object with keys among {sorted(known)} expected, got {unknown}")
    if recipe.get("preset") is not None and recipe["preset"] not in PRESETS:
        raise ConfigError(f"recipe {path}: unknown preset {recipe['preset']!r}; choose one of {sorted(PRESETS)}")
    classes = {"model": TransformerConfig, "data": DataConfig, "optim": OptimConfig, "loop": LoopConfig}
    for group, cls in classes.items():
        values = recipe.get(group, {})
        if not isinstance(values, dict):
            raise ConfigError(f"recipe {path}: {group!r} must be a JSON object of {cls.__name__} fields")
        cls.from_dict(values, source=f"recipe {path}, {group!r}")
    return recipe


def _choose_recipe(name: str | None, given_data: Mapping[str, Any], stored: Mapping[str, Any] | None) -> str | None:
    """The recipe of a run: the one named, else (on a resume) the stored one, else the task's default."""
    if name is not None and stored is None:
        load_recipe(name)  # fails early, naming what is wrong
    if stored is not None:
        saved = stored.get("recipe")
        if name is not None and name != saved:
            raise UsageError(
                f"--resume: the run was started with recipe {saved!r}; a resume continues with its stored "
                f"settings (leave out --recipe {name})"
            )
        if "recipe" in stored:
            return saved
        files = stored["data"].get("src") or stored["data"].get("tsv")  # a checkpoint from before recipes
    else:
        files = given_data.get("src") or given_data.get("tsv")
    return name or DEFAULT_RECIPE["files" if files else "numbers"]


def _resolve_data(
    given: Mapping[str, Any], stored: Mapping[str, Any] | None, defaults: Mapping[str, Any] | None = None
) -> DataConfig:
    """The run's DataConfig: given, else the recipe's `defaults`. On a resume the stored files and batching stay;
    new validation files may be given."""
    if stored is None:
        return DataConfig.from_dict({**(defaults or {}), **given})
    # Runs from before packed batches existed batched by length buckets; before row_multiple was a setting, the
    # rows of every batch were a multiple of the device count.
    saved = {"batching": "buckets", "row_multiple": stored.get("devices") or 1, **stored["data"]}
    for name in FROZEN_DATA_FIELDS:
        if name in given and given[name] is not None:
            value = str(Path(given[name]).absolute()) if name in ("src", "tgt", "tsv") else given[name]
            _check_frozen(name, value, saved.get(name))
    return DataConfig.from_dict({**saved, **{k: v for k, v in given.items() if k not in FROZEN_DATA_FIELDS}})


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


def _check_frozen(name: str, given: Any, stored: Any) -> None:
    if given is not None and given != stored:
        raise UsageError(
            f"--resume: the checkpoint was trained with {name}={stored!r}, but {name}={given!r} was "
            f"given; an exact resume needs the same value (leave the flag out)"
        )


def _describe_files(data: DataConfig) -> str:
    files = [getattr(data, name) for name in ("src", "tgt", "tsv") if getattr(data, name)]
    return ", ".join(files) or "the built-in numbers task"


# A format-1 checkpoint (before settings were grouped) stored its run settings flat; this maps them.
_FORMAT1_LOOP = (
    "steps",
    "eval_every",
    "save_every",
    "max_minutes",
    "keep",
    "eval_beam_size",
    "beam_size",
    "alpha",
    "eval_sentences",
    "samples",
)


def stored_settings(restored: ckpt_lib.Checkpoint) -> dict[str, Any]:
    """The run settings a checkpoint stored, as {"preset", "seed", "data", "optim", "loop", ...}."""
    run = dict(restored.run)
    if restored.format >= 2:
        return {**run, "optim": dict(restored.optim)}
    data: dict[str, Any] = {
        k: run[k] for k in ("vocab_size", "tokenizer_type", "max_tokens", "on_empty", "on_too_long") if k in run
    }
    for prefix, spec in (("", run.get("train_data")), ("valid_", run.get("valid_data"))):
        if spec and spec.get("kind") == "parallel":
            data.update({prefix + "src": spec["src"], prefix + "tgt": spec["tgt"]})
        elif spec and spec.get("kind") == "tsv":
            data[prefix + "tsv"] = spec["tsv"]
    try:
        data_config = DataConfig.from_dict(data, source=f"{restored.directory} (format 1) data settings")
    except (DataError, ConfigError) as e:
        raise ckpt_lib.CheckpointError(
            f"{restored.directory}: cannot read the run settings of this format-1 "
            f"checkpoint to resume it ({e}); evaluate, translate and export still work"
        ) from None
    return {
        "preset": run.get("preset"),
        "seed": run.get("seed", 0),
        "data": data_config.to_dict(),
        "optim": dict(restored.optim),
        "loop": {k: run[k] for k in _FORMAT1_LOOP if k in run},
        "train_fingerprint": run.get("train_fingerprint"),
        "devices": run.get("devices"),
    }
