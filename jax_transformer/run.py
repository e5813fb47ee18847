"""Setting up and running a training run: the one function `train.py train` calls, usable from Python as well.

    from jax_transformer import run
    result = run.train(run_dir="runs/de-en", preset="small",
                       data={"src": "train.de", "tgt": "train.en", "valid_src": "val.de", "valid_tgt": "val.en"},
                       optim={"warmup_steps": 300, "lr_scale": 0.5}, loop={"steps": 4000, "max_minutes": 50})
    result = run.train(resume="runs/de-en", loop={"steps": 8000})          # continue it, exactly

Settings come in four groups, each the fields of one dataclass: `model` (`TransformerConfig`), `data`
(`DataConfig`), `optim` (`OptimConfig`) and `loop` (`LoopConfig`); `train.py`'s flags are those field names. A
group given as a partial dict is completed from, in this order of precedence: what is given; on a resume, what
the checkpoint stored; the defaults of the task (the built-in numbers task when no data files are given, which
has its own small defaults in `NUMBERS_TASK_DEFAULTS`); the dataclass defaults.

`prepare` follows the data one way: read the corpus -> train (or restore) the tokenizer -> build (or restore,
or import from PyTorch) the model config and weights -> encode and batch -> a `Trainer` ready to run. A resume
checks that nothing an exact continuation depends on has changed (data, tokenizer, optimiser, seed, model) and
names the setting that did.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax

from jax_transformer import checkpoint as ckpt_lib
from jax_transformer import compilation
from jax_transformer.config import (
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

GROUPS = ("model", "data", "optim", "loop")

# The built-in numbers task: sized to reach a useful model on 2 CPU cores in about two minutes (README).
NUMBERS_TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "model": {"max_len": 32},
    "data": {"vocab_size": 256, "tokenizer_type": "bpe", "max_tokens": 2048},
    "optim": {"lr_scale": 2.0, "warmup_steps": 400},
    "loop": {"steps": 1000, "eval_every": 500, "save_every": 500},
}
DEFAULT_PRESET = {"numbers": "tiny", "files": "small"}

# What an exact resume needs unchanged (validation files, the loop's budgets and the decoding may change).
FROZEN_DATA_FIELDS = (
    "src",
    "tgt",
    "tsv",
    "vocab_size",
    "tokenizer_type",
    "max_tokens",
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


def train(*, print_fn: Callable[[str], None] = print, **settings: Any) -> RunResult:
    """Prepares a run (see `prepare` for the arguments), trains it to its end and closes its checkpoints."""
    prepared = prepare(print_fn=print_fn, **settings)
    try:
        result = prepared.trainer.run()
    finally:
        prepared.checkpoints.close()
    return dataclasses.replace(
        result, checkpoint_dir=prepared.checkpoints.directory, best_step=prepared.checkpoints.best_step()
    )


def prepare(
    *,
    run_dir: str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    init_from_torch: str | os.PathLike | None = None,
    preset_name: str | None = None,
    seed: int | None = None,
    model: Mapping[str, Any] | None = None,
    data: Mapping[str, Any] | None = None,
    optim: Mapping[str, Any] | None = None,
    loop: Mapping[str, Any] | None = None,
    start_time: float | None = None,
    print_fn: Callable[[str], None] = print,
) -> PreparedRun:
    """Sets up a training run and returns it ready to run.

    run_dir: where checkpoints, metrics.jsonl, loss_curve.png, tokenizer.model and config.json go (default
      runs/<date-time>); resume: continue the run in this directory from its latest checkpoint (no run_dir);
    init_from_torch: start from the weights of a PyTorch file (`jax_transformer.export`);
    preset_name: "tiny", "small" or "base" (default: tiny for the numbers task, small for files);
    seed: of initialisation, dropout and data order (default 0);
    model / data / optim / loop: partial dicts of TransformerConfig / DataConfig / OptimConfig / LoopConfig fields.
    """
    start_time = time.time() if start_time is None else start_time
    given = {"model": dict(model or {}), "data": dict(data or {}), "optim": dict(optim or {}), "loop": dict(loop or {})}
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
        restored = ckpt_lib.load(run_dir, "latest")
        stored = stored_settings(restored)
        print_fn(f"resuming {run_dir} from step {restored.step}")
    else:
        run_dir = Path(run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        folder = run_dir / ckpt_lib.CHECKPOINT_SUBDIR
        if folder.is_dir() and any(folder.iterdir()):
            raise UsageError(
                f"{run_dir} already holds checkpoints: continue it with --resume {run_dir}, or choose another --run-dir"
            )

    # --- settings: given, else stored, else the task's defaults -------------------------------------------------
    data_config = _resolve_data(given["data"], stored)
    task = "numbers" if data_config.uses_default_task else "files"
    task_defaults = NUMBERS_TASK_DEFAULTS if task == "numbers" else {group: {} for group in GROUPS}
    if stored is not None:
        _check_frozen("seed", seed, stored["seed"])
        for name, value in given["optim"].items():
            _check_frozen(name, value, stored["optim"].get(name))
    seed = stored["seed"] if stored is not None else (0 if seed is None else seed)
    optim_config = OptimConfig.from_dict(
        {**task_defaults["optim"], **(stored or {}).get("optim", {}), **given["optim"]}, source="optimiser settings"
    )
    loop_config = LoopConfig.from_dict(
        {**task_defaults["loop"], **(stored or {}).get("loop", {}), **given["loop"]}, source="loop settings"
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
    preset_name = preset_name or (stored or {}).get("preset") or DEFAULT_PRESET[task]
    if preset_name not in PRESETS:
        raise ConfigError(f"unknown preset {preset_name!r}; choose one of {sorted(PRESETS)}")
    model_fields = {**task_defaults["model"], **given["model"]}
    params = None
    if restored is not None:
        tokenizer = restored.tokenizer
        # Model settings given on a resume must describe the saved model: any difference is named.
        changes = {**(PRESETS[explicit_preset] if explicit_preset else {}), **given["model"]}
        requested = restored.config.replace(**changes) if changes else restored.config
        ckpt_lib.check_config(restored.config, requested, where=f"checkpoint in {run_dir}")
        config = restored.config
    elif init_from_torch is not None:
        params, config, tokenizer = _init_from_torch(
            init_from_torch,
            train_corpus,
            data_config,
            preset_name,
            model_fields,
            explicit=bool(given["model"]),
            print_fn=print_fn,
        )
    else:
        tokenizer = train_tokenizer(train_corpus, data_config, print_fn)
        config = model_config(preset_name, tokenizer.vocab_size, model_fields)

    # --- batches ----------------------------------------------------------------------------------------------
    cache_dir = compilation.use_cache(loop_config.compilation_cache, print_fn)  # before the model's programs compile
    n_devices = jax.local_device_count()
    if stored is not None and stored.get("devices", n_devices) != n_devices:
        raise UsageError(
            f"--resume: the checkpoint was trained on {stored['devices']} device(s), this machine has "
            f"{n_devices}; batches are split per device, so an exact resume needs the same count"
        )
    encoded = encode_corpus(train_corpus, tokenizer, config.max_len, on_too_long=data_config.on_too_long)
    print_fn(f"training data: {encoded.describe()}")
    packed = data_config.batching == "packed"
    stream = BatchStream(
        encoded,
        data_config.max_tokens,
        batching=data_config.batching,
        pack_length=data_config.pack_length,
        row_multiple=1 if packed else n_devices,  # packed rows do not depend on the device count
        seed=seed,
        state=None if restored is None else restored.data_state,
    )
    rows = stream.shapes[0][0]
    if packed and rows % n_devices:
        raise UsageError(
            f"packed batches of {stream.shapes[0]} (rows x length) do not split over {n_devices} devices; choose "
            f"--max-tokens so that max_tokens // pack_length is a multiple of {n_devices}"
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
        "seed": seed,
        "data": data_config.absolute().to_dict(),
        "loop": loop_config.to_dict(),
        "train_fingerprint": fingerprint,
        "devices": n_devices,
    }
    manager = ckpt_lib.CheckpointManager(run_dir / ckpt_lib.CHECKPOINT_SUBDIR, keep=loop_config.keep)
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(run_dir / "tokenizer.model")
    (run_dir / "config.json").write_text(config.to_json() + "\n", encoding="utf-8")
    if restored is not None:
        truncate_metrics(run_dir / "metrics.jsonl", restored.step)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    print_fn(
        f"model: {n_params:,} parameters, d_model {config.d_model}, {config.num_encoder_layers}+"
        f"{config.num_decoder_layers} layers, vocabulary {config.src_vocab_size}; {n_devices} device(s) "
        f"({jax.devices()[0].platform}); {_describe_batches(stream)}; run directory {run_dir}; compilation "
        f"cache {cache_dir or 'off'}"
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
        n_devices=n_devices,
        start_time=start_time,
        print_fn=print_fn,
    )
    return PreparedRun(trainer, manager, config, tokenizer, run_dir, settings)


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
    print_fn,
) -> tuple[Any, TransformerConfig, Tokenizer]:
    """Weights, config and tokenizer for --init-from-torch. Model settings given explicitly describe (or must
    agree with) the model in the file; the file's own tokenizer wins over a freshly trained one."""
    from jax_transformer.export import import_weights

    tokenizer = requested = None
    if explicit:
        tokenizer = train_tokenizer(corpus, data, print_fn)
        requested = model_config(preset_name, tokenizer.vocab_size, model_fields)
    params, config, file_tokenizer = import_weights(path, requested)
    if file_tokenizer is not None:
        tokenizer = file_tokenizer  # the vocabulary the weights were trained with
    elif tokenizer is None:
        tokenizer = train_tokenizer(corpus, data, print_fn)
    if tokenizer.vocab_size != config.src_vocab_size or tokenizer.vocab_size != config.tgt_vocab_size:
        raise ckpt_lib.CheckpointError(
            f"--init-from-torch {path}: the model's vocabulary (src_vocab_size {config.src_vocab_size}, "
            f"tgt_vocab_size {config.tgt_vocab_size}) does not match the tokenizer's {tokenizer.vocab_size} pieces; "
            f"the file carries no tokenizer, so pass --vocab-size to match"
        )
    print_fn(f"initialised from PyTorch weights {path}")
    return params, config, tokenizer


def _resolve_data(given: Mapping[str, Any], stored: Mapping[str, Any] | None) -> DataConfig:
    """The run's DataConfig. On a resume the stored files and batching stay; new validation files may be given."""
    if stored is None:
        defaults = NUMBERS_TASK_DEFAULTS["data"] if not (given.get("src") or given.get("tsv")) else {}
        return DataConfig.from_dict({**defaults, **given})
    # Runs from before packed batches existed batched by length buckets.
    saved = {"batching": "buckets", **stored["data"]}
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
