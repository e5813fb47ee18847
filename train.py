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
    from jax_transformer.distributed import ParallelConfig
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
    g.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the run in DIR from its newest intact checkpoint, exactly (damaged newer ones are moved to "
        "DIR/checkpoints-damaged with a warning)",
    )
    g.add_argument(
        "--strict-resume",
        action="store_true",
        help="with --resume: stop with an error if the newest checkpoint is damaged, instead of falling back",
    )
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
    add_settings(
        t,
        ParallelConfig,
        "parallel",
        "devices and processes (README, Scaling out): every process of a multi-process run gets the same flags "
        "except --process-id, and sees the same data files and run directory",
    )
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

    tr = sub.add_parser(
        "translate",
        help="translate lines of text (stdin or --input) to stdout",
        description="Translate UTF-8 text, one sentence per line, to stdout: exactly one output line per input "
        "line (an empty line stays empty), read and translated in chunks, so input of any size streams through.",
    )
    _add_checkpoint_flags(tr)
    tr.add_argument("--input", metavar="FILE", help="UTF-8 file with one sentence per line (default: stdin)")
    _add_decoding_flags(tr)
    tr.add_argument(
        "--on-too-long",
        choices=("error", "truncate"),
        default="error",
        help="a line longer than the model's max_len tokens: stop with an error naming the line (after writing "
        "the lines before it), or translate its first max_len - 1 tokens and report the line (default error)",
    )
    tr.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
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
    """The given (not None) settings flags as {"model": {...}, "data": {...}, "optim": {...}, "loop": {...},
    "parallel": {...}}."""
    groups = {"model": {}, "data": {}, "optim": {}, "loop": {}, "parallel": {}}
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
        strict_resume=args.strict_resume,
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

    loaded = checkpoint.load(args.checkpoint, args.step)  # verified: a damaged step is a CheckpointError
    compute = {name: getattr(args, name, None) for name in ("dtype", "attention_kernel")}
    compute = {name: value for name, value in compute.items() if value is not None}
    if compute:  # how to compute is not part of the model: any checkpoint runs in either dtype
        loaded = dataclasses.replace(loaded, config=loaded.config.replace(**compute))
    note = "" if loaded.verified else f", format {loaded.format}, written before checksums: not verified"
    print(f"loaded {loaded.directory} step {loaded.step} ({loaded.config.dtype}{note})", file=sys.stderr)
    return loaded


def cmd_evaluate(args, start_time: float) -> int:
    from jax_transformer import data, evaluation, run, training
    from jax_transformer.checks import check_batch
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
    for i, batch in enumerate(valid.batches):
        check_batch(batch, loaded.config, f"evaluation batch {i}")
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
    from jax_transformer.data import count_lines, read_lines
    from jax_transformer.decoding import translate_lines

    loaded = _load(args)
    # Read, translated and written a chunk of lines at a time: memory does not grow with the input.
    if args.input:
        origin, lines, total = args.input, read_lines(args.input), count_lines(args.input)
    else:
        origin, lines, total = "stdin", read_lines(sys.stdin.buffer, origin="stdin"), None
    out = getattr(sys.stdout, "buffer", None)  # UTF-8 whatever the locale says
    write = (lambda text: out.write(text.encode("utf-8") + b"\n")) if out else (lambda text: print(text))
    try:
        report = translate_lines(
            loaded.params,
            loaded.config,
            loaded.tokenizer,
            (text for _, text in lines),
            write,
            origin=origin,
            on_too_long=args.on_too_long,
            total=total,
            progress=args.progress,
            beam_size=args.beam_size,
            alpha=args.alpha,
        )
    finally:
        sys.stdout.flush()
    print(report.describe(), file=sys.stderr)
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


def _quiet_closed_loop_callbacks() -> None:
    """When orbax fails to read or write a checkpoint, it closes its asyncio loop while tensorstore still has
    operations in flight; their completions then print "RuntimeError: Event loop is closed" tracebacks (through
    sys.unraisablehook or sys.excepthook) after the CheckpointError was reported. Exactly those are dropped."""
    if getattr(sys.unraisablehook, "quiets_closed_loop_callbacks", False):
        return

    def closed_loop_callback(kind, value, tb) -> bool:
        if kind is not RuntimeError or str(value) != "Event loop is closed":
            return False
        frames = []
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_name)
            tb = tb.tb_next
        return "call_soon_threadsafe" in frames

    previous_excepthook, previous_unraisablehook = sys.excepthook, sys.unraisablehook

    def excepthook(kind, value, tb):
        if not closed_loop_callback(kind, value, tb):
            previous_excepthook(kind, value, tb)

    def unraisablehook(unraisable):
        if not closed_loop_callback(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback):
            previous_unraisablehook(unraisable)

    unraisablehook.quiets_closed_loop_callbacks = True
    sys.excepthook, sys.unraisablehook = excepthook, unraisablehook


def main(argv: list[str] | None = None) -> int:
    start_time = time.time()
    _quiet_closed_loop_callbacks()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["train"] + argv  # `train` is the default sub-command
    args = build_parser().parse_args(argv)

    from jax_transformer.checkpoint import CheckpointError
    from jax_transformer.checks import TokenError
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
    except (DataError, ConfigError, CheckpointError, PortError, UsageError, TokenError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:  # the machine's, not the program's: a full disk, a missing permission
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:  # before or after the training loop, which handles Ctrl-C itself
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
