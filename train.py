#!/usr/bin/env python3
"""Train, evaluate and use the Transformer from the command line.

    python train.py                                   # train on the built-in English->French numbers task
    python train.py train --src train.de --tgt train.en --valid-src val.de --valid-tgt val.en --preset small
    python train.py train --resume runs/my-run        # continue a run exactly where it stopped
    python train.py evaluate --checkpoint runs/my-run
    echo "ein Hund läuft" | python train.py translate --checkpoint runs/my-run
    python train.py export --checkpoint runs/my-run --output model.pt
    python train.py attention --checkpoint runs/my-run --sentence "ein Hund läuft" --output attention.png

`python train.py SUBCOMMAND --help` lists every flag. The training flags are the fields of the settings
dataclasses, named after them (`TransformerConfig.d_model` is `--d-model`, `OptimConfig.warmup_steps` is
`--warmup-steps`), so this file only turns flags into calls of `jax_transformer.run` and friends.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import typing
from pathlib import Path

COMMANDS = ("train", "evaluate", "translate", "export", "attention")

# Exit codes: 0 done, 1 bad input / config / checkpoint, 2 bad flags (argparse), 3 training diverged (NaN),
# 128 + signal number when stopped by SIGINT (130) or SIGTERM (143) after saving a checkpoint.
EXIT_ERROR, EXIT_DIVERGED = 1, 3
ALIASES = {"warmup_steps": ["--warmup"]}  # old spellings people have in their scripts


def add_settings(parser: argparse.ArgumentParser, cls, group: str, title: str, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of the settings dataclass `cls`, named after it, stored as "<group>.<field>". Flags
    default to None (not given), so that `jax_transformer.run` can tell what the user chose."""
    section = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        kind = hints[field.name]
        types = [t for t in typing.get_args(kind) if t is not type(None)] or [kind]
        flag = "--" + field.name.replace("_", "-")
        default = field.default if field.default is not None else "none"
        options = dict(dest=f"{group}.{field.name}", default=None, help=f"{field.metadata['help']} (default {default})")
        if types[0] is bool:
            section.add_argument(flag, action=argparse.BooleanOptionalAction, **options)
        else:
            choices = field.metadata.get("choices")
            metavar = None if choices else {int: "N", float: "X"}.get(types[0], "FILE" if group == "data" else "S")
            section.add_argument(
                flag, *ALIASES.get(field.name, []), type=types[0], metavar=metavar, choices=choices, **options
            )


def build_parser() -> argparse.ArgumentParser:
    from jax_transformer.config import OptimConfig, TransformerConfig
    from jax_transformer.data import DataConfig
    from jax_transformer.trainer import LoopConfig

    parser = argparse.ArgumentParser(
        prog="train.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train and use the encoder-decoder Transformer (Flax). With no sub-command, `train` runs; "
        "with no arguments at all it trains on the built-in English->French numbers task.",
        epilog="Run `train.py SUBCOMMAND --help` for the flags of each sub-command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND")

    t = sub.add_parser(
        "train",
        help="train a model (the default sub-command)",
        description="Train a model. Without data files: the built-in English->French numbers task "
        "(tiny model, ~2 minutes on 2 CPU cores, with its own defaults: "
        "jax_transformer.run.NUMBERS_TASK_DEFAULTS).",
    )
    g = t.add_argument_group("run")
    g.add_argument(
        "--run-dir",
        metavar="DIR",
        help="where checkpoints, metrics.jsonl, loss_curve.png and tokenizer.model go (default runs/<date-time>)",
    )
    g.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint, exactly")
    g.add_argument(
        "--init-from-torch",
        metavar="FILE",
        help="start from the weights of a PyTorch file, torch.save "
        "or safetensors (from `train.py export`, or a bare torch_reference state_dict described by the "
        "model flags)",
    )
    g.add_argument(
        "--preset",
        choices=("tiny", "small", "base"),
        help="model size: tiny (2+2 layers, d_model 32), "
        "small (3+3, 256), base (6+6, 512, the paper's); model flags override its fields (default: tiny "
        "for the numbers task, small for files)",
    )
    g.add_argument("--seed", type=int, help="seed of initialisation, dropout and data order (default 0)")
    add_settings(t, DataConfig, "data", "data (UTF-8 text, one sentence per line; or source<TAB>target lines)")
    add_settings(
        t,
        TransformerConfig,
        "model",
        "model (TransformerConfig; defaults: the preset's)",
        skip=("src_vocab_size", "tgt_vocab_size", "pad_id", "bos_id", "eos_id"),
    )  # the tokenizer's
    add_settings(t, OptimConfig, "optim", "optimiser (Adam, the paper's schedule, label smoothing)")
    add_settings(t, LoopConfig, "loop", "run loop: steps, evaluation, checkpoints")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("evaluate", help="validation loss, perplexity, accuracy, BLEU and chrF of a checkpoint")
    _add_checkpoint_flags(e)
    e.add_argument("--src", metavar="FILE", help="source sentences (default: the run's validation data)")
    e.add_argument("--tgt", metavar="FILE", help="reference translations, line-aligned with --src")
    e.add_argument("--tsv", metavar="FILE", help="source<TAB>reference lines (instead of --src/--tgt)")
    _add_decoding_flags(e)
    e.add_argument(
        "--max-tokens", type=int, default=4096, metavar="N", help="token slots per loss batch (default 4096)"
    )
    e.add_argument("--samples", type=int, default=5, metavar="N", help="sample translations to print (default 5)")
    e.add_argument("--output", metavar="FILE", help="also write the translations to FILE, one per line")
    e.set_defaults(func=cmd_evaluate)

    tr = sub.add_parser("translate", help="translate lines of text (stdin or --input) to stdout")
    _add_checkpoint_flags(tr)
    tr.add_argument("--input", metavar="FILE", help="UTF-8 file with one sentence per line (default: stdin)")
    _add_decoding_flags(tr)
    tr.set_defaults(func=cmd_translate)

    x = sub.add_parser("export", help="write a checkpoint's weights as a PyTorch file for torch_reference")
    _add_checkpoint_flags(x)
    x.add_argument(
        "--output",
        required=True,
        metavar="FILE",
        help="the file to write: torch.save of {format, config (JSON), state_dict, tokenizer}, or a "
        "safetensors file (no pickle) with the config and tokenizer in its metadata",
    )
    x.add_argument(
        "--format",
        choices=("torch", "safetensors"),
        help="file format (default: safetensors for a .safetensors name, torch otherwise)",
    )
    x.set_defaults(func=cmd_export)

    a = sub.add_parser(
        "attention",
        help="draw the attention weights of a checkpoint on one sentence (PNG)",
        description="Translate one sentence greedily and draw every head's attention as heatmaps.",
    )
    _add_checkpoint_flags(a)
    a.add_argument("--sentence", required=True, help="the source sentence")
    a.add_argument("--output", default="attention.png", metavar="FILE", help="the PNG to write (default attention.png)")
    a.add_argument(
        "--kinds",
        nargs="+",
        default=["cross"],
        choices=("cross", "self", "encoder"),
        help="which attention: cross (decoder over the source), self (decoder self-attention), encoder "
        "(encoder self-attention); one grid row per layer, one column per head (default cross)",
    )
    a.set_defaults(func=cmd_attention)
    return parser


def _add_checkpoint_flags(p) -> None:
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="run directory (or its checkpoints/ folder) written by `train.py train`",
    )
    p.add_argument(
        "--step",
        default="best",
        metavar="STEP",
        help="which checkpoint: 'best' (highest validation score, the default), 'latest' or a number",
    )


def _add_decoding_flags(p) -> None:
    from jax_transformer.config import ATTENTION_KERNELS, DTYPES

    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="compute dtype of the matmuls (default: the checkpoint's); the parameters are float32 either way",
    )
    p.add_argument(
        "--attention-kernel",
        choices=ATTENTION_KERNELS,
        help="attention implementation (default: the checkpoint's; see `train.py train --help`)",
    )
    p.add_argument("--beam-size", type=int, default=4, metavar="K", help="beam width; 1 is greedy search (default 4)")
    p.add_argument(
        "--alpha",
        type=float,
        default=0.6,
        help="length penalty exponent of beam search, ((5+len)/6)^alpha (default 0.6)",
    )


def _print(text: str = "") -> None:
    print(text, flush=True)


def _groups(args) -> dict[str, dict]:
    """The given (not None) settings flags as {"model": {...}, "data": {...}, "optim": {...}, "loop": {...}}."""
    groups = {"model": {}, "data": {}, "optim": {}, "loop": {}}
    for dest, value in vars(args).items():
        if "." in dest and value is not None:
            group, name = dest.split(".", 1)
            groups[group][name] = value
    return groups


def cmd_train(args, start_time: float) -> int:
    from jax_transformer import run

    result = run.train(
        run_dir=args.run_dir,
        resume=args.resume,
        init_from_torch=args.init_from_torch,
        preset_name=args.preset,
        seed=args.seed,
        start_time=start_time,
        print_fn=_print,
        **_groups(args),
    )
    _print(
        f"done: step {result.step} ({result.stopped_by}), {(time.time() - start_time) / 60:.1f} minutes; "
        f"checkpoints in {result.checkpoint_dir} (best step {result.best_step})"
    )
    if result.curve is not None:
        _print(f"loss curve: {result.curve}")
    if result.stopped_by.startswith("SIG"):
        import signal

        return 128 + int(getattr(signal, result.stopped_by))
    return 0


def _load(args):
    """The checkpoint, its model computed as --dtype / --attention-kernel ask (where the sub-command has them)."""
    from jax_transformer import checkpoint

    loaded = checkpoint.load(args.checkpoint, args.step)
    compute = {name: getattr(args, name, None) for name in ("dtype", "attention_kernel")}
    compute = {name: value for name, value in compute.items() if value is not None}
    if compute:  # how to compute is not part of the model: any checkpoint runs in either dtype
        loaded = dataclasses.replace(loaded, config=loaded.config.replace(**compute))
    print(f"loaded {loaded.directory} step {loaded.step} ({loaded.config.dtype})", file=sys.stderr)
    return loaded


def cmd_evaluate(args, start_time: float) -> int:
    from jax_transformer import data, evaluation, run, training
    from jax_transformer.trainer import ValidationSet

    loaded = _load(args)
    if args.src or args.tgt or args.tsv:
        files = data.DataConfig(src=args.src, tgt=args.tgt, tsv=args.tsv)
        corpus = data.load_corpus(files, "train")  # the given files, read as a training corpus is
    else:
        corpus = data.load_corpus(data.DataConfig.from_dict(run.stored_settings(loaded)["data"]), "valid")
        if corpus is None:
            raise run.UsageError("the run had no validation data: give --src/--tgt or --tsv")
    encoded = data.encode_corpus(corpus, loaded.tokenizer, loaded.config.max_len, on_too_long="skip")
    print(f"evaluation data: {corpus.describe()}; {encoded.describe()}", file=sys.stderr)
    valid = ValidationSet.from_encoded(encoded, corpus, args.max_tokens)
    eval_step = training.make_eval_step(loaded.config, loaded.optim.get("label_smoothing", 0.1))
    result = {"step": loaded.step, **training.evaluate_loss(loaded.params, eval_step, valid.batches)}
    scores, hypotheses = evaluation.evaluate_translations(
        loaded.params,
        loaded.config,
        loaded.tokenizer,
        valid.sources,
        valid.references,
        beam_size=args.beam_size,
        alpha=args.alpha,
    )
    result.update(scores, beam_size=args.beam_size, alpha=args.alpha, sentences=len(valid.sources))
    for i in evaluation.spread_indices(len(hypotheses), args.samples):
        _print(f"  source:    {valid.sources[i]}\n  reference: {valid.references[i]}\n  model:     {hypotheses[i]}")
    if args.output:
        Path(args.output).write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    _print(json.dumps(result))
    return 0


def cmd_translate(args, start_time: float) -> int:
    from jax_transformer.data import DataError
    from jax_transformer.decoding import translate

    loaded = _load(args)
    try:
        text = Path(args.input).read_text(encoding="utf-8") if args.input else sys.stdin.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{args.input or 'stdin'}: cannot read: {e}") from None
    lines = text.splitlines()
    todo = [i for i, line in enumerate(lines) if line.strip()]  # empty lines stay empty
    outputs = [""] * len(lines)
    translations = (
        translate(
            loaded.params,
            loaded.config,
            loaded.tokenizer,
            [lines[i] for i in todo],
            beam_size=args.beam_size,
            alpha=args.alpha,
        )
        if todo
        else []
    )
    for i, translation in zip(todo, translations):
        outputs[i] = translation
    sys.stdout.write("".join(line + "\n" for line in outputs))
    return 0


def cmd_export(args, start_time: float) -> int:
    from jax_transformer import export

    loaded = _load(args)
    path = export.export_weights(args.output, loaded.params, loaded.config, loaded.tokenizer, format=args.format)
    _print(f"wrote {path}: the torch_reference state_dict of step {loaded.step} with its config and tokenizer")
    return 0


def cmd_attention(args, start_time: float) -> int:
    from jax_transformer import visualize

    loaded = _load(args)
    path = visualize.plot_attention(
        loaded.params, loaded.config, loaded.tokenizer, args.sentence, args.output, kinds=args.kinds
    )
    _print(f"wrote {path} (greedy translation; attention of {', '.join(args.kinds)})")
    return 0


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
    from jax_transformer.run import UsageError
    from jax_transformer.trainer import TrainingError

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
