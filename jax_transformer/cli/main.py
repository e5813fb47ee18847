"""The command line's main: parse the flags (one parser per sub-command, from `jax_transformer.cli`'s modules),
run the sub-command, and turn the errors a user can cause (`jax_transformer.errors`) into one "error: ..." line and
its exit status.

Train, evaluate and use the Transformer from the command line.

    jax-transformer                                   # train on the built-in English->French numbers task
    jax-transformer train --src train.de --tgt train.en --valid-src val.de --valid-tgt val.en --preset small
    jax-transformer train --resume runs/my-run        # continue a run exactly where it stopped
    jax-transformer train --recipe multi30k --src train.de --tgt train.en --valid-src val.de --valid-tgt val.en
    jax-transformer evaluate --checkpoint runs/my-run
    jax-transformer evaluate --checkpoint runs/my-run --beam-size 1 4 --alpha 0.6 1.0   # choose the decoding
    echo "ein Hund läuft" | jax-transformer translate --checkpoint runs/my-run
    jax-transformer translate --checkpoint runs/my-run --n-best 4 --output-format jsonl < sentences.txt
    jax-transformer translate --checkpoint runs/my-run --do-sample --top-p 0.9 --sample-seed 1   # back-translation
    jax-transformer score --checkpoint runs/my-run --tsv pairs.tsv > scores.txt           # filter a corpus
    jax-transformer export --checkpoint runs/my-run --output model.pt
    jax-transformer import opus-mt-de-en/ --output runs/opus-de-en     # a transformers Marian/FSMT dir, or fairseq .pt
    jax-transformer import facebook/nllb-200-distilled-600M --output runs/nllb          # a hub name (its cache offline)
    jax-transformer train --init-from runs/nllb --lora-rank 16 --schedule linear --lr 1e-3 --warmup-steps 100 ...
    jax-transformer export --checkpoint runs/nllb-lora --format peft --output adapter   # for peft.PeftModel
    jax-transformer export --checkpoint runs/opus-de-en --format transformers --output opus-de-en-hf
    jax-transformer attention --checkpoint runs/my-run --sentence "ein Hund läuft" --output attention.png
    jax-transformer average --checkpoint runs/my-run --last 5 --output runs/my-run-avg5
    jax-transformer verify --checkpoint runs/my-run        # the PyTorch twin against Flax on the validation set
    jax-transformer plot --runs runs/a runs/b --output quality.png       # BLEU and loss against minutes

`jax-transformer SUBCOMMAND --help` (or `python train.py SUBCOMMAND --help`) lists every flag.

Exit status: 0 done, 1 bad input, settings or checkpoint (one "error: ..." line), 2 bad flags (argparse), 3 the
training diverged (a non-finite loss), 4 `verify` found the frameworks apart, 5 another process of a
multi-process run stopped answering, 128 + N when stopped by signal N (130 SIGINT, 143 SIGTERM) after saving,
141 (as SIGPIPE) quietly when the reader of stdout went away (`translate | head`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from jax_transformer.cli import (
    attention,
    average,
    evaluate,
    export,
    import_model,
    output,
    plan,
    plot,
    score,
    serve,
    train,
    translate,
    verify,
)

# The sub-commands in the order `--help` lists them, each a module with `add(sub)` and `run(args, start_time)`.
COMMANDS = {
    "train": train,
    "evaluate": evaluate,
    "translate": translate,
    "score": score,
    "export": export,
    "import": import_model,
    "attention": attention,
    "average": average,
    "verify": verify,
    "plot": plot,
    "plan": plan,
    "serve": serve,
}
EXIT_ERROR = 1  # bad input, settings or checkpoint; and the machine's errors (OSError)
EXIT_BROKEN_PIPE = 128 + 13  # SIGPIPE's: what a Unix tool killed by it reports


def exit_codes() -> tuple[tuple[type[BaseException], int], ...]:
    """The errors a user can cause (`jax_transformer.errors`) and the exit status of each, the most specific first:
    each is reported as one "error: ..." line, never a traceback."""
    from jax_transformer import errors

    return (
        (errors.TrainingError, 3),  # the training diverged (a non-finite loss)
        (errors.ConfigError, EXIT_ERROR),
        (errors.DataError, EXIT_ERROR),
        (errors.UsageError, EXIT_ERROR),
        (errors.CheckpointError, EXIT_ERROR),
        (errors.PortError, EXIT_ERROR),
        (errors.TokenError, EXIT_ERROR),
    )


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    prog = prog or _prog()
    parser = argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train and use the encoder-decoder Transformer (Flax). With no sub-command, `train` runs; "
        "with no arguments at all it trains on the built-in English->French numbers task.",
        epilog=f"Run `{prog} SUBCOMMAND --help` for the flags of each sub-command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND")
    for command in COMMANDS.values():
        command.add(sub)
    return parser


def _prog() -> str:
    """The name the user typed: the console script's, else train.py (also for `python -m` and tests)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name == "jax-transformer" else "train.py"


def main(argv: list[str] | None = None) -> int:
    from jax_transformer.checkpoint.hooks import quiet_closed_loop_callbacks

    start_time = time.time()
    quiet_closed_loop_callbacks()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["train"] + argv  # `train` is the default sub-command
    args = build_parser().parse_args(argv)
    codes = exit_codes()
    try:
        return args.func(args, start_time)
    except tuple(kind for kind, _ in codes) as e:
        print(f"error: {e}", file=sys.stderr)
        return next(code for kind, code in codes if isinstance(e, kind))
    except BrokenPipeError as e:
        if not output.stdout_closed():  # another pipe or socket (a peer process): an error like any other
            print(f"error: {e}", file=sys.stderr)
            return EXIT_ERROR
        output.discard_stdout()  # the reader of stdout went away (`| head`): end quietly, as Unix tools do
        return EXIT_BROKEN_PIPE
    except OSError as e:  # the machine's, not the program's: a full disk, a missing permission
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:  # before or after the training loop, which handles Ctrl-C itself
        print("interrupted", file=sys.stderr)
        return 130
