#!/usr/bin/env python3
"""Train, evaluate and use the Transformer from the command line.

    python train.py                                   # train on the built-in English->French numbers task
    python train.py train --src train.de --tgt train.en --valid-src val.de --valid-tgt val.en --preset small
    python train.py train --resume runs/my-run        # continue a run exactly where it stopped
    python train.py evaluate --checkpoint runs/my-run
    echo "ein Hund läuft" | python train.py translate --checkpoint runs/my-run
    python train.py export --checkpoint runs/my-run --output model.pt
    python train.py attention --checkpoint runs/my-run --sentence "ein Hund läuft" --output attention.png

`python train.py SUBCOMMAND --help` lists every flag. The work is done by `jax_transformer.training` and
`jax_transformer.checkpoint`; this file only turns flags into calls. torch is imported only by the sub-commands
that read or write a PyTorch file (`export`, `train --init-from-torch`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

COMMANDS = ("train", "evaluate", "translate", "export", "attention")

# Exit codes: 0 done, 1 bad input / config / checkpoint, 2 bad flags (argparse), 3 training diverged (NaN),
# 128 + signal number when stopped by SIGINT (130) or SIGTERM (143) after saving a checkpoint.
EXIT_ERROR, EXIT_DIVERGED = 1, 3


class UsageError(ValueError):
    """Flags that do not fit together."""


# =============================================================================================================
# Defaults. Flags default to None so that a resumed run can tell "given" from "not given"; these fill the rest.
# =============================================================================================================

# The built-in numbers task: sized to reach a useful model on 2 CPU cores in about two minutes (see README).
DEFAULT_TASK_SETTINGS = dict(
    preset="tiny", steps=1000, max_tokens=2048, lr_scale=2.0, warmup=400, eval_every=500, save_every=500,
    vocab_size=256, tokenizer_type="bpe", max_len=32, eval_sentences=None,
)
# Your own data: the paper's schedule on the "small" model; raise --steps to taste.
FILE_DATA_SETTINGS = dict(
    preset="small", steps=20000, max_tokens=4096, lr_scale=1.0, warmup=4000, eval_every=2000, save_every=1000,
    vocab_size=8000, tokenizer_type="unigram", max_len=None, eval_sentences=None,
)
COMMON_SETTINGS = dict(
    seed=0, on_empty="skip", on_too_long="skip", label_smoothing=0.1, clip_norm=None, weight_decay=0.0,
    max_minutes=None, keep=3, eval_beam_size=1, beam_size=4, alpha=0.6, samples=5,
)
# Settings a resumed run must share with the checkpoint for the resume to be exact.
FROZEN_ON_RESUME = ("train_data", "seed", "on_empty", "on_too_long", "max_tokens", "vocab_size", "tokenizer_type",
                    "lr_scale", "warmup", "label_smoothing", "clip_norm", "weight_decay")
MODEL_FLAGS = {"d_model": "d_model", "heads": "num_heads", "d_ff": "d_ff", "encoder_layers": "num_encoder_layers",
               "decoder_layers": "num_decoder_layers", "max_len": "max_len"}


# =============================================================================================================
# Flags
# =============================================================================================================


def _add(group, *flags, help, **kw):
    """A flag whose default is None (resolved later); `help` should say the default."""
    group.add_argument(*flags, default=None, help=help, **kw)


def _set_value(text: str):
    """--set key=value -> (key, value); the value is read as JSON when it can be (numbers, true/false)."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--set expects key=value, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def _add_checkpoint_flags(p) -> None:
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="run directory (or its checkpoints/ folder) written by `train.py train`")
    p.add_argument("--step", default="best", metavar="STEP",
                   help="which checkpoint: 'best' (highest validation score, the default), 'latest' or a number")


def _add_decoding_flags(p, beam_default: str = "4") -> None:
    _add(p, "--beam-size", type=int, metavar="K", help=f"beam width; 1 is greedy search (default {beam_default})")
    _add(p, "--alpha", type=float, help="length penalty exponent of beam search, ((5+len)/6)^alpha (default 0.6)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train and use the encoder-decoder Transformer (Flax). With no sub-command, `train` runs; "
                    "with no arguments at all it trains on the built-in English->French numbers task.",
        epilog="Run `train.py SUBCOMMAND --help` for the flags of each sub-command.")
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND")

    # --- train -------------------------------------------------------------------------------------------------
    t = sub.add_parser("train", help="train a model (the default sub-command)",
                       description="Train a model. Without data flags: the built-in English->French numbers task "
                                   "(tiny model, ~2 minutes on 2 CPU cores). Defaults marked 'numbers/files' "
                                   "differ between the built-in task and your own files.")
    g = t.add_argument_group("data (UTF-8 text, one sentence per line; or source<TAB>target lines)")
    _add(g, "--src", metavar="FILE", help="training source sentences (line-aligned with --tgt)")
    _add(g, "--tgt", metavar="FILE", help="training target sentences")
    _add(g, "--tsv", metavar="FILE", help="training pairs as source<TAB>target lines (instead of --src/--tgt)")
    _add(g, "--valid-src", metavar="FILE", help="validation source sentences (for loss, BLEU, chrF)")
    _add(g, "--valid-tgt", metavar="FILE", help="validation target sentences")
    _add(g, "--valid-tsv", metavar="FILE", help="validation pairs as source<TAB>target lines")
    _add(g, "--on-empty", choices=("skip", "error"),
         help="a pair with an empty side: skip and count it, or stop with an error naming the line (default skip)")
    _add(g, "--on-too-long", choices=("skip", "error"),
         help="a pair longer than --max-len tokens: skip and count it, or stop with an error (default skip)")
    _add(g, "--vocab-size", type=int, metavar="N",
         help="joint SentencePiece vocabulary size, an upper bound (default numbers 256 / files 8000)")
    _add(g, "--tokenizer-type", choices=("unigram", "bpe"), help="SentencePiece model (default numbers bpe / files unigram)")
    _add(g, "--max-tokens", type=int, metavar="N",
         help="token slots per batch (rows x padded length) (default numbers 2048 / files 4096)")

    g = t.add_argument_group("model")
    _add(g, "--preset", choices=("tiny", "small", "base"),
         help="model size: tiny (2+2 layers, d_model 32), small (3+3, 256), base (6+6, 512, the paper's) "
              "(default numbers tiny / files small)")
    _add(g, "--d-model", type=int, metavar="D", help="override the preset's model width")
    _add(g, "--heads", type=int, metavar="H", help="override the number of attention heads")
    _add(g, "--d-ff", type=int, metavar="F", help="override the feed-forward inner width")
    _add(g, "--layers", type=int, metavar="N", help="override both encoder and decoder layer counts")
    _add(g, "--encoder-layers", type=int, metavar="N", help="override the encoder layer count")
    _add(g, "--decoder-layers", type=int, metavar="N", help="override the decoder layer count")
    _add(g, "--max-len", type=int, metavar="N",
         help="longest sequence in tokens, EOS/BOS included (default numbers 32 / files the preset's)")
    _add(g, "--dropout", type=float, metavar="P", help="residual and embedding dropout, the paper's P_drop (default 0.1)")
    t.add_argument("--set", type=_set_value, action="append", default=[], metavar="KEY=VALUE",
                   help="set any TransformerConfig field, e.g. --set norm_first=true --set positions=learned "
                        "(repeatable). Source and target share one vocabulary, so share_embeddings defaults to "
                        "true here")

    g = t.add_argument_group("optimisation (Adam b1=0.9, b2=0.98, eps=1e-9; paper section 5.3)")
    _add(g, "--steps", type=int, metavar="N", help="total optimiser steps (default numbers 1000 / files 20000)")
    _add(g, "--lr-scale", type=float, metavar="S",
         help="multiplies the learning rate S * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) "
              "(default numbers 2.0 / files 1.0)")
    _add(g, "--warmup", type=int, metavar="N", help="warmup steps of the schedule (default numbers 400 / files 4000)")
    _add(g, "--label-smoothing", type=float, metavar="EPS", help="label smoothing epsilon (default 0.1)")
    _add(g, "--clip-norm", type=float, metavar="C", help="clip the global gradient norm to C (default: no clipping)")
    _add(g, "--weight-decay", type=float, metavar="W",
         help="decoupled weight decay (AdamW) on weight matrices (default 0: plain Adam)")
    _add(g, "--seed", type=int, help="seed of initialisation, dropout and data order (default 0)")

    g = t.add_argument_group("run")
    _add(g, "--run-dir", metavar="DIR",
         help="where checkpoints, metrics.jsonl, loss_curve.png and tokenizer.model go (default runs/<time>)")
    _add(g, "--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint, exactly")
    _add(g, "--init-from-torch", metavar="FILE",
         help="start from weights in a PyTorch file (from `train.py export`, or a bare torch_reference "
              "state_dict with the model flags describing it)")
    _add(g, "--max-minutes", type=float, metavar="M",
         help="stop training after M minutes of wall time since the command started, then evaluate and save")
    _add(g, "--eval-every", type=int, metavar="N",
         help="validate every N steps and keep the best checkpoint (default numbers 500 / files 2000)")
    _add(g, "--save-every", type=int, metavar="N", help="checkpoint every N steps (default numbers 500 / files 1000)")
    _add(g, "--keep", type=int, metavar="K", help="keep the last K checkpoints, plus the best (default 3)")
    _add(g, "--eval-beam-size", type=int, metavar="K",
         help="beam width of the BLEU evaluations during training (default 1: greedy, fast)")
    _add(g, "--eval-sentences", type=int, metavar="N",
         help="compute BLEU/chrF of the evaluations during training on the first N validation sentences; the "
              "final evaluation uses all (default: all; 0: no BLEU at all, loss only)")
    _add_decoding_flags(g)
    _add(g, "--samples", type=int, metavar="N", help="sample translations printed by the final evaluation (default 5)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_train)

    # --- evaluate ----------------------------------------------------------------------------------------------
    e = sub.add_parser("evaluate", help="validation loss, perplexity, accuracy, BLEU and chrF of a checkpoint")
    _add_checkpoint_flags(e)
    _add(e, "--src", metavar="FILE", help="source sentences (default: the run's validation data)")
    _add(e, "--tgt", metavar="FILE", help="reference translations")
    _add(e, "--tsv", metavar="FILE", help="source<TAB>reference lines (instead of --src/--tgt)")
    _add_decoding_flags(e)
    e.add_argument("--max-tokens", type=int, default=4096, metavar="N", help="token slots per loss batch (default 4096)")
    e.add_argument("--samples", type=int, default=5, metavar="N", help="sample translations to print (default 5)")
    e.add_argument("--output", metavar="FILE", help="also write the translations to FILE, one per line")
    e.set_defaults(func=cmd_evaluate)

    # --- translate ---------------------------------------------------------------------------------------------
    tr = sub.add_parser("translate", help="translate lines of text (stdin or --input) to stdout")
    _add_checkpoint_flags(tr)
    tr.add_argument("--input", metavar="FILE", help="UTF-8 file with one sentence per line (default: stdin)")
    _add_decoding_flags(tr)
    tr.set_defaults(func=cmd_translate)

    # --- export ------------------------------------------------------------------------------------------------
    x = sub.add_parser("export", help="write a checkpoint's weights as a PyTorch file for torch_reference")
    _add_checkpoint_flags(x)
    x.add_argument("--output", required=True, metavar="FILE",
                   help="the .pt file: {format, config (JSON), state_dict, tokenizer}")
    x.set_defaults(func=cmd_export)

    # --- attention ---------------------------------------------------------------------------------------------
    a = sub.add_parser("attention", help="draw the attention weights of a checkpoint on one sentence (PNG)",
                       description="Translate one sentence greedily and draw every head's attention as heatmaps.")
    _add_checkpoint_flags(a)
    a.add_argument("--sentence", required=True, help="the source sentence")
    a.add_argument("--output", default="attention.png", metavar="FILE", help="the PNG to write (default attention.png)")
    a.add_argument("--kinds", nargs="+", default=["cross"], choices=("cross", "self", "encoder"),
                   help="which attention: cross (decoder over the source), self (decoder self-attention), encoder "
                        "(encoder self-attention); one grid row per layer, one column per head (default cross)")
    a.set_defaults(func=cmd_attention)
    return parser


# =============================================================================================================
# train
# =============================================================================================================


def _resolve(args, stored: dict | None, defaults: dict) -> dict:
    """Settings of this run: flags given, else the checkpoint's (when resuming), else the defaults.
    A flag that contradicts a frozen setting of the checkpoint is an error naming it."""
    settings = {}
    for key, default in defaults.items():
        given = getattr(args, key, None)
        if stored is not None and key in stored:
            if given is not None and key in FROZEN_ON_RESUME and given != stored[key]:
                raise UsageError(f"--resume: the checkpoint was trained with {key}={stored[key]!r}, but "
                                 f"{key}={given!r} was given; an exact resume needs the same value "
                                 f"(leave the flag out)")
            settings[key] = stored[key] if given is None else given
        else:
            settings[key] = default if given is None else given
    return settings


def _config_overrides(args) -> dict:
    """TransformerConfig fields set by model flags (not the preset)."""
    overrides = {field: getattr(args, flag) for flag, field in MODEL_FLAGS.items() if getattr(args, flag) is not None}
    if args.layers is not None:
        overrides.setdefault("num_encoder_layers", args.layers)
        overrides.setdefault("num_decoder_layers", args.layers)
    if args.dropout is not None:
        overrides.update(dropout=args.dropout, embedding_dropout=args.dropout)
    overrides.update(dict(args.set))
    return overrides


def _model_config(args, settings, vocab_size: int, base=None):
    """The model config: `base` (a checkpoint's / PyTorch file's) with the flags given applied, or a preset."""
    from jax_transformer.config import PRESETS, TransformerConfig, preset

    overrides = _config_overrides(args)
    if base is not None:
        fields = dict(PRESETS[args.preset]) if args.preset is not None else {}
        return base.replace(**{**fields, **overrides}) if fields or overrides else base
    fields = dict(src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, share_embeddings=True)
    if settings["max_len"] is not None:
        fields["max_len"] = settings["max_len"]
    return preset(settings["preset"], **{**fields, **overrides})


def _print(text: str = "") -> None:
    print(text, flush=True)


def cmd_train(args, start_time: float) -> int:
    import jax

    from jax_transformer import checkpoint as ckpt_lib
    from jax_transformer import training
    from jax_transformer.data import BatchStream, Tokenizer, encode_corpus

    if args.resume is not None and args.init_from_torch is not None:
        raise UsageError("--resume and --init-from-torch exclude each other: a resume already has weights")
    if args.resume is not None and args.run_dir is not None and Path(args.run_dir).absolute() != Path(args.resume).absolute():
        raise UsageError("--resume DIR continues in DIR; leave out --run-dir")

    # --- where the run lives, and what a resume restores ----------------------------------------------------
    restored = None
    if args.resume is not None:
        run_dir = Path(args.resume)
        if not (run_dir / ckpt_lib.CHECKPOINT_SUBDIR).is_dir():
            raise ckpt_lib.CheckpointError(f"--resume {run_dir}: no {ckpt_lib.CHECKPOINT_SUBDIR}/ folder there; "
                                           f"give the run directory of an earlier `train.py train`")
        restored = ckpt_lib.load(run_dir, "latest")
        stored = restored.run
        _print(f"resuming {run_dir} from step {restored.step}")
    else:
        run_dir = Path(args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        if (run_dir / ckpt_lib.CHECKPOINT_SUBDIR).is_dir() and any((run_dir / ckpt_lib.CHECKPOINT_SUBDIR).iterdir()):
            raise UsageError(f"{run_dir} already holds checkpoints: continue it with --resume {run_dir}, "
                             f"or choose another --run-dir")
        stored = None

    # --- data ---------------------------------------------------------------------------------------------------
    if stored is not None:
        train_spec = training.data_spec(src=args.src, tgt=args.tgt, tsv=args.tsv) or stored["train_data"]
        if train_spec != stored["train_data"]:
            raise UsageError(f"--resume: the checkpoint was trained on {stored['train_data']}, not {train_spec}")
        valid_spec = (training.data_spec(src=args.valid_src, tgt=args.valid_tgt, tsv=args.valid_tsv,
                                         what="validation") or stored.get("valid_data"))
    else:
        train_spec = training.data_spec(src=args.src, tgt=args.tgt, tsv=args.tsv, default="train")
        default_valid = "valid" if train_spec["kind"] == "default" else None
        valid_spec = training.data_spec(src=args.valid_src, tgt=args.valid_tgt, tsv=args.valid_tsv,
                                        default=default_valid, what="validation")
    defaults = dict(DEFAULT_TASK_SETTINGS if train_spec["kind"] == "default" else FILE_DATA_SETTINGS,
                    **COMMON_SETTINGS)
    settings = _resolve(args, stored, defaults)
    settings.update(train_data=train_spec, valid_data=valid_spec)

    train_corpus = training.load_corpus(train_spec, on_empty=settings["on_empty"])
    _print(f"training data: {train_corpus.describe()}")
    fingerprint = training.corpus_fingerprint(train_corpus)
    if stored is not None and stored.get("train_fingerprint") not in (None, fingerprint):
        raise UsageError(f"--resume: the training data changed since the checkpoint was written "
                         f"({train_spec}); an exact resume needs the same data")
    settings["train_fingerprint"] = fingerprint
    valid_corpus = None
    if valid_spec is not None:
        valid_corpus = training.load_corpus(valid_spec, on_empty=settings["on_empty"])
        _print(f"validation data: {valid_corpus.describe()}")
    else:
        _print("no validation data (--valid-src/--valid-tgt or --valid-tsv): no BLEU, the best checkpoint is the last")

    # --- tokenizer and model config ---------------------------------------------------------------------------
    init_params = None
    if restored is not None:
        tokenizer = restored.tokenizer
        config = _model_config(args, settings, tokenizer.vocab_size, base=restored.config)
        ckpt_lib.check_config(restored.config, config, where=f"checkpoint in {run_dir}")
    elif args.init_from_torch is not None:
        init_params, config, tokenizer = _init_from_torch(args, settings, train_corpus)
    else:
        tokenizer = _train_tokenizer(train_corpus, settings)
        config = _model_config(args, settings, tokenizer.vocab_size)

    # --- batches ----------------------------------------------------------------------------------------------
    n_devices = jax.local_device_count()
    if stored is not None and stored.get("devices", n_devices) != n_devices:
        raise UsageError(f"--resume: the checkpoint was trained on {stored['devices']} device(s), this machine has "
                         f"{n_devices}; batches are split per device, so an exact resume needs the same count")
    settings["devices"] = n_devices
    encoded = encode_corpus(train_corpus, tokenizer, config.max_len, on_too_long=settings["on_too_long"])
    _print(f"training data: {encoded.describe()}")
    stream = BatchStream(encoded, settings["max_tokens"], row_multiple=n_devices, seed=settings["seed"],
                         state=None if restored is None else restored.data_state)
    valid = None
    if valid_corpus is not None:
        valid_encoded = encode_corpus(valid_corpus, tokenizer, config.max_len, on_too_long=settings["on_too_long"])
        _print(f"validation data: {valid_encoded.describe()}")
        valid = training.ValidationSet.from_encoded(valid_encoded, valid_corpus, settings["max_tokens"])

    # --- state --------------------------------------------------------------------------------------------------
    optim = training.OptimConfig(lr_scale=settings["lr_scale"], warmup_steps=settings["warmup"],
                                 label_smoothing=settings["label_smoothing"], clip_norm=settings["clip_norm"],
                                 weight_decay=settings["weight_decay"])
    if restored is not None:
        state = restored.train_state()
    else:
        state = training.create_train_state(config, optim, seed=settings["seed"], params=init_params)
    manager = ckpt_lib.CheckpointManager(run_dir / ckpt_lib.CHECKPOINT_SUBDIR, keep=settings["keep"])
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(run_dir / "tokenizer.model")
    (run_dir / "config.json").write_text(config.to_json() + "\n", encoding="utf-8")
    if restored is not None:
        training.truncate_metrics(run_dir / "metrics.jsonl", restored.step)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    _print(f"model: {n_params:,} parameters, d_model {config.d_model}, {config.num_encoder_layers}+"
           f"{config.num_decoder_layers} layers, vocabulary {config.src_vocab_size}; {n_devices} device(s) "
           f"({jax.devices()[0].platform}); batches of ~{settings['max_tokens']} token slots, "
           f"{stream.batches_per_epoch} per epoch; run directory {run_dir}")

    loop = training.LoopConfig(
        steps=settings["steps"], eval_every=settings["eval_every"], save_every=settings["save_every"],
        max_minutes=settings["max_minutes"], eval_beam_size=settings["eval_beam_size"],
        final_beam_size=settings["beam_size"], alpha=settings["alpha"], eval_sentences=settings["eval_sentences"],
        samples=settings["samples"], progress=not args.no_progress)
    trainer = training.Trainer(config=config, optim=optim, tokenizer=tokenizer, stream=stream, state=state,
                               loop=loop, run_dir=run_dir, checkpoints=manager, valid=valid,
                               run_settings=settings, n_devices=n_devices, start_time=start_time, print_fn=_print)
    try:
        result = trainer.run()
    finally:
        manager.close()
    _print(f"done: step {result.step} ({result.stopped_by}), {(time.time() - start_time) / 60:.1f} minutes; "
           f"checkpoints in {manager.directory} (best step {manager.best_step()})")
    if result.curve is not None:
        _print(f"loss curve: {result.curve}")
    if result.stopped_by.startswith("SIG"):
        import signal

        return 128 + int(getattr(signal, result.stopped_by))
    return 0


def _train_tokenizer(corpus, settings):
    from jax_transformer.data import Tokenizer

    _print(f"training a joint {settings['tokenizer_type']} SentencePiece tokenizer "
           f"(vocabulary up to {settings['vocab_size']}) on {len(corpus)} pairs ...")
    return Tokenizer.train(corpus.sources + corpus.targets, settings["vocab_size"],
                           model_type=settings["tokenizer_type"])


def _init_from_torch(args, settings, corpus):
    """Weights, config and tokenizer for --init-from-torch."""
    from jax_transformer import checkpoint as ckpt_lib
    from jax_transformer import export as export_lib

    model_flags_given = args.preset is not None or bool(_config_overrides(args))
    requested = None
    tokenizer = None
    if model_flags_given:  # the flags describe (or must agree with) the model in the file
        tokenizer = _train_tokenizer(corpus, settings)
        requested = _model_config(args, settings, tokenizer.vocab_size)
    params, config, file_tokenizer = export_lib.import_weights(args.init_from_torch, requested)
    if file_tokenizer is not None:
        tokenizer = file_tokenizer  # the vocabulary the weights were trained with
    elif tokenizer is None:
        tokenizer = _train_tokenizer(corpus, settings)
    if tokenizer.vocab_size != config.src_vocab_size or tokenizer.vocab_size != config.tgt_vocab_size:
        raise ckpt_lib.CheckpointError(
            f"--init-from-torch {args.init_from_torch}: the model's vocabulary (src_vocab_size "
            f"{config.src_vocab_size}, tgt_vocab_size {config.tgt_vocab_size}) does not match the tokenizer's "
            f"{tokenizer.vocab_size} pieces; the file carries no tokenizer, so pass --vocab-size to match")
    _print(f"initialised from PyTorch weights {args.init_from_torch}")
    return params, config, tokenizer


# =============================================================================================================
# evaluate / translate / export / attention
# =============================================================================================================


def _load(args):
    from jax_transformer import checkpoint as ckpt_lib

    loaded = ckpt_lib.load(args.checkpoint, args.step)
    print(f"loaded {loaded.directory} step {loaded.step}", file=sys.stderr)
    return loaded


def _decoding(args) -> dict:
    return {"beam_size": 4 if args.beam_size is None else args.beam_size,
            "alpha": 0.6 if args.alpha is None else args.alpha}


def _require_decoder() -> None:
    from jax_transformer import training

    if not training.decoder_available():
        raise UsageError("translation needs jax_transformer.decoding, which is not installed in this tree")


def cmd_evaluate(args, start_time: float) -> int:
    from jax_transformer import training
    from jax_transformer.data import encode_corpus

    loaded = _load(args)
    spec = training.data_spec(src=args.src, tgt=args.tgt, tsv=args.tsv, what="evaluation")
    spec = spec or loaded.run.get("valid_data")
    if spec is None:
        raise UsageError("the run had no validation data: give --src/--tgt or --tsv")
    corpus = training.load_corpus(spec, on_empty="skip")
    encoded = encode_corpus(corpus, loaded.tokenizer, loaded.config.max_len, on_too_long="skip")
    print(f"evaluation data: {corpus.describe()}; {encoded.describe()}", file=sys.stderr)
    valid = training.ValidationSet.from_encoded(encoded, corpus, args.max_tokens)
    label_smoothing = loaded.optim.get("label_smoothing", 0.1)
    eval_step = training.make_eval_step(loaded.config, label_smoothing)
    result = {"step": loaded.step, **training.evaluate_loss(loaded.params, eval_step, valid.batches)}
    if training.decoder_available():
        scores, hypotheses = training.evaluate_translations(loaded.params, loaded.config, loaded.tokenizer,
                                                            valid.sources, valid.references, **_decoding(args))
        result.update(scores, **_decoding(args), sentences=len(valid.sources))
        for i in training.spread_indices(len(hypotheses), args.samples):
            _print(f"  source:    {valid.sources[i]}\n  reference: {valid.references[i]}\n  model:     {hypotheses[i]}")
        if args.output:
            Path(args.output).write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    else:
        print("no BLEU/chrF: jax_transformer.decoding is not available", file=sys.stderr)
    _print(json.dumps(result))
    return 0


def cmd_translate(args, start_time: float) -> int:
    from jax_transformer import training
    from jax_transformer.data import DataError

    _require_decoder()
    loaded = _load(args)
    try:
        text = Path(args.input).read_text(encoding="utf-8") if args.input else sys.stdin.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{args.input or 'stdin'}: cannot read: {e}") from None
    lines = text.splitlines()
    todo = [i for i, line in enumerate(lines) if line.strip()]  # empty lines stay empty
    outputs = [""] * len(lines)
    if todo:
        translations = training.translate_sentences(loaded.params, loaded.config, loaded.tokenizer,
                                                    [lines[i] for i in todo], **_decoding(args))
        for i, translation in zip(todo, translations):
            outputs[i] = translation
    sys.stdout.write("".join(line + "\n" for line in outputs))
    return 0


def cmd_export(args, start_time: float) -> int:
    from jax_transformer import export as export_lib

    loaded = _load(args)
    path = export_lib.export_weights(args.output, loaded.params, loaded.config, loaded.tokenizer)
    _print(f"wrote {path}: torch_reference state_dict of step {loaded.step} with its config and tokenizer")
    return 0


def cmd_attention(args, start_time: float) -> int:
    _require_decoder()
    from jax_transformer import visualize

    loaded = _load(args)
    path = visualize.plot_attention(loaded.params, loaded.config, loaded.tokenizer, args.sentence, args.output,
                                    kinds=args.kinds)
    _print(f"wrote {path} (greedy translation; attention of {', '.join(args.kinds)})")
    return 0


# =============================================================================================================
# main
# =============================================================================================================


def main(argv: list[str] | None = None) -> int:
    start_time = time.time()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["train"] + argv  # `train` is the default sub-command
    args = build_parser().parse_args(argv)

    from jax_transformer.checkpoint import CheckpointError
    from jax_transformer.config import ConfigError
    from jax_transformer.data import DataError
    from jax_transformer.port import PortError
    from jax_transformer.training import TrainingError

    try:
        return args.func(args, start_time)
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    except (DataError, ConfigError, CheckpointError, PortError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:  # before or after the training loop, which handles Ctrl-C itself
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
