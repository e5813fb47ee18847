#!/usr/bin/env python3
"""Train, evaluate and use the Transformer from the command line.

    python train.py                                   # train on the built-in English->French numbers task
    python train.py train --src train.de --tgt train.en --valid-src val.de --valid-tgt val.en --preset small
    python train.py train --resume runs/my-run        # continue a run exactly where it stopped
    python train.py train --recipe multi30k --src train.de --tgt train.en --valid-src val.de --valid-tgt val.en
    python train.py evaluate --checkpoint runs/my-run
    python train.py evaluate --checkpoint runs/my-run --beam-size 1 4 --alpha 0.6 1.0   # choose the decoding
    echo "ein Hund läuft" | python train.py translate --checkpoint runs/my-run
    python train.py translate --checkpoint runs/my-run --n-best 4 --output-format jsonl < sentences.txt
    python train.py translate --checkpoint runs/my-run --do-sample --top-p 0.9 --sample-seed 1   # back-translation
    python train.py score --checkpoint runs/my-run --tsv pairs.tsv > scores.txt           # filter a corpus
    python train.py export --checkpoint runs/my-run --output model.pt
    python train.py import opus-mt-de-en/ --output runs/opus-de-en     # a transformers Marian/FSMT dir, or fairseq .pt
    python train.py import facebook/nllb-200-distilled-600M --output runs/nllb          # a hub name (its cache offline)
    python train.py train --init-from runs/nllb --lora-rank 16 --schedule linear --lr 1e-3 --warmup-steps 100 ...
    python train.py export --checkpoint runs/nllb-lora --format peft --output adapter   # for peft.PeftModel
    python train.py export --checkpoint runs/opus-de-en --format transformers --output opus-de-en-hf
    python train.py attention --checkpoint runs/my-run --sentence "ein Hund läuft" --output attention.png
    python train.py average --checkpoint runs/my-run --last 5 --output runs/my-run-avg5
    python train.py verify --checkpoint runs/my-run        # the PyTorch twin against Flax on the validation set
    python train.py plot --runs runs/a runs/b --output quality.png       # BLEU and loss against minutes

`python train.py SUBCOMMAND --help` lists every flag. A flag that is a setting is a field of a settings dataclass
(`jax_transformer.config`), named after it (`TransformerConfig.d_model` is `--d-model`) and declared once, there.

Exit status: 0 done, 1 bad input, settings or checkpoint (one "error: ..." line), 2 bad flags (argparse), 3 the
training diverged (a non-finite loss), 4 `verify` found the frameworks apart, 5 another process of a
multi-process run stopped answering, 128 + N when stopped by signal N (130 SIGINT, 143 SIGTERM) after saving,
141 (as SIGPIPE) quietly when the reader of stdout went away (`translate | head`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import typing

COMMANDS = (
    "train",
    "evaluate",
    "translate",
    "score",
    "export",
    "import",
    "attention",
    "average",
    "verify",
    "plot",
    "plan",
    "serve",
)
EXIT_ERROR, EXIT_DIVERGED, EXIT_NOT_VERIFIED = 1, 3, 4  # and distributed.EXIT_PEER_LOST (5)
EXIT_BROKEN_PIPE = 128 + 13  # SIGPIPE's: what a Unix tool killed by it reports
ALIASES = {"warmup_steps": ["--warmup"]}  # old spellings people have in their scripts


def add_settings(
    parser: argparse.ArgumentParser,
    cls,
    group: str,
    title: str,
    *,
    only: tuple[str, ...] | None = None,
    skip: tuple[str, ...] = (),
    several: tuple[str, ...] = (),
    default: str | None = None,
) -> None:
    """One flag per field of the settings dataclass `cls` (or the fields `only`), named after it, stored as
    "<group>.<field>". Flags default to None (not given), so that what the user chose can be told from the rest;
    `several` fields take one or more values; `default` replaces the help's default (e.g. "the checkpoint's")."""
    section = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip or (only is not None and field.name not in only):
            continue
        types = [t for t in typing.get_args(hints[field.name]) if t is not type(None)] or [hints[field.name]]
        flag = "--" + field.name.replace("_", "-")
        shown = default or ("none" if field.default is None else field.default)
        options = dict(dest=f"{group}.{field.name}", default=None, help=f"{field.metadata['help']} (default {shown})")
        if types[0] is bool:
            section.add_argument(flag, action=argparse.BooleanOptionalAction, **options)
            continue
        choices = field.metadata.get("choices")
        text = "CODE" if field.name.endswith("_lang") else "FILE" if group == "data" else "S"
        metavar = None if choices else {int: "N", float: "X"}.get(types[0], text)
        nargs = "+" if field.name in several else None
        kind = types[0] if choices else setting_type(cls, field, types[0])
        section.add_argument(
            flag, *ALIASES.get(field.name, []), type=kind, metavar=metavar, choices=choices, nargs=nargs, **options
        )


def setting_type(cls, field, kind):
    """The argparse type of a settings flag: the value parsed as `kind`, then checked as its settings group checks
    the field (`config.check_field`: range, finiteness), so that a bad value is a parse error naming the flag, in
    every sub-command alike, before a file is read or JAX starts."""
    from jax_transformer.config import check_field

    def parse(text: str):
        value = kind(text)  # a ValueError here: argparse's "invalid int value: 'x'"
        try:
            check_field(cls, field, value)
        except ValueError as e:  # argparse names the flag: the message's own "(--flag)" would say it twice
            raise argparse.ArgumentTypeError(str(e).removesuffix(f" (--{field.name.replace('_', '-')})")) from None
        return value

    parse.__name__ = kind.__name__
    low, above = field.metadata.get("at_least"), field.metadata.get("above")
    parse.bounds = (low if low is not None else above, field.metadata.get("below"))  # for the tests' sweep
    return parse


def number(kind, at_least: float, below: float | None = None):
    """The argparse type of a plain numeric flag (not a setting): `kind` in [at_least, below), finite."""

    def parse(text: str):
        value = kind(text)
        if not (math.isfinite(value) and value >= at_least and (below is None or value < below)):
            bound = f"in [{at_least}, {below})" if below is not None else f">= {at_least}"
            raise argparse.ArgumentTypeError(f"must be {'an int' if kind is int else 'a number'} {bound}, got {text}")
        return value

    parse.__name__ = kind.__name__
    parse.bounds = (at_least, below)
    return parse


def given(args, group: str) -> dict:
    """The settings flags of `group` that were given, as {field: value}."""
    prefix = group + "."
    return {dest[len(prefix) :]: v for dest, v in vars(args).items() if dest.startswith(prefix) and v is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train and use the encoder-decoder Transformer (Flax). With no sub-command, `train` runs; "
        "with no arguments at all it trains on the built-in English->French numbers task.",
        epilog="Run `train.py SUBCOMMAND --help` for the flags of each sub-command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND")
    for add in (train_flags, evaluate_flags, translate_flags, score_flags, export_flags, import_flags,
                attention_flags, average_flags, verify_flags, plot_flags, plan_flags, serve_flags):  # fmt: skip
        add(sub)
    return parser


def train_flags(sub) -> None:
    from jax_transformer.config import (
        RECIPES,
        DataConfig,
        DecodeConfig,
        LoopConfig,
        OptimConfig,
        ParallelConfig,
        TransformerConfig,
    )

    t = sub.add_parser(
        "train",
        help="train a model (the default sub-command)",
        description="Train a model. Without data files: the built-in English->French numbers task (tiny model, "
        "~2 minutes on 2 CPU cores, with its own defaults: the recipe jax_transformer/configs/recipes/numbers.json).",
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
        help="start from the weights of a PyTorch file, torch.save or safetensors (from `train.py export`, or a "
        "bare torch_reference state_dict described by the model flags)",
    )
    g.add_argument(
        "--init-from",
        metavar="DIR",
        help="start from the best checkpoint of a run directory (e.g. one `train.py import` wrote from a pretrained "
        "model): its weights, config, tokenizer and decoding; the data is encoded with its tokenizer",
    )
    g.add_argument(
        "--preset",
        choices=("tiny", "small", "base"),
        help="model size: tiny (2+2 layers, d_model 32), small (3+3, 256), base (6+6, 512, the paper's); model "
        "flags override its fields (default: the recipe's, else tiny for the numbers task, small for files)",
    )
    g.add_argument(
        "--recipe",
        metavar="NAME",
        help="a named set of settings (jax_transformer/configs/recipes/NAME.json) under the flags given: "
        + "; ".join(f"{name}: {recipe['about']}" for name, recipe in sorted(RECIPES.items()))
        + "; or a recipe JSON file of the same form (default: numbers without data files, none with them)",
    )
    g.add_argument(
        "--seed",
        type=number(int, 0, 2**32),
        help="seed of initialisation, dropout and data order, a 32-bit number (default 0)",
    )
    g.add_argument(
        "--keep-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="where JAX computes on the CPU: keep the memory a training step frees for the next step (glibc's "
        "malloc: one arena, no mmap, no trimming) instead of returning it to the system and faulting it back in "
        "every step, a tenth of a small step (jax_transformer.host_memory). The process's resident memory then "
        "stays near its peak: turn it off where memory is tight or several processes share the machine (default on)",
    )
    add_settings(t, DataConfig, "data", "data (UTF-8 text, one sentence per line; or source<TAB>target lines)")
    add_settings(
        t,
        TransformerConfig,
        "model",
        "model (TransformerConfig; defaults: the preset's)",
        skip=("src_vocab_size", "tgt_vocab_size", "pad_id", "bos_id", "eos_id"),  # the tokenizer's
    )
    add_settings(t, OptimConfig, "optim", "optimiser (Adam, the paper's schedule, label smoothing)")
    add_settings(t, LoopConfig, "loop", "run loop: steps, evaluation, checkpoints")
    add_settings(t, DecodeConfig, "decode", "decoding rules of the evaluations")
    add_settings(
        t,
        ParallelConfig,
        "parallel",
        "devices and processes (docs/scaling.md): every process of a multi-process run gets the same flags "
        "except --process-id, and sees the same data files and run directory",
    )
    t.set_defaults(func=cmd_train)


def checkpoint_flags(p, *, compute: bool = False, mesh: bool = False) -> None:
    """--checkpoint and --step; with `compute`, how to compute (--dtype, --attention-kernel: TransformerConfig's);
    with `mesh`, --mesh: the weights read straight onto a mesh of the devices, split as training splits them."""
    from jax_transformer.config import COMPUTE_FIELDS, ParallelConfig, TransformerConfig

    p.add_argument(
        "--checkpoint", required=True, metavar="DIR", help="run directory (or its checkpoints/ folder) of a training"
    )
    p.add_argument(
        "--step",
        default="best",
        metavar="STEP",
        help="which checkpoint: 'best' (highest validation score, the default), 'latest' or a number",
    )
    if compute:
        add_settings(p, TransformerConfig, "model", "how to compute", only=COMPUTE_FIELDS, default="the checkpoint's")
    if mesh:
        add_settings(p, ParallelConfig, "parallel", "devices", only=("mesh",), default="one device")


def language_flags(p) -> None:
    """--src-lang and --tgt-lang: a multilingual model's languages (default: the tokenizer's, stored at import)."""
    from jax_transformer.config import DataConfig

    add_settings(p, DataConfig, "data", "languages", only=("src_lang", "tgt_lang"), default="the tokenizer's")


def decoding_flags(
    p, *, several: bool = False, more: tuple[str, ...] = (), only: tuple[str, ...] | None = None
) -> None:
    """Every decoding choice (DecodeConfig's fields, or the `only` ones; default: what the checkpoint stored) and
    the `more` LoopConfig fields named; with `several`, --beam-size and --alpha take lists."""
    from jax_transformer.config import DecodeConfig, LoopConfig

    lists = ("beam_size", "alpha") if several else ()
    add_settings(p, DecodeConfig, "decode", "decoding", only=only, several=lists, default="the run's")
    if more:
        add_settings(p, LoopConfig, "loop", "output", only=more)


def compilation_flags(p) -> None:
    """--compilation-cache (LoopConfig's): where the programs of a sub-command that decodes are kept for the next."""
    from jax_transformer.config import LoopConfig

    add_settings(p, LoopConfig, "loop", "compilation", only=("compilation_cache",))


def use_compilation_cache(args) -> None:
    """JAX's persistent compilation cache for a sub-command that decodes, in the folder --compilation-cache names
    (default: the one training uses, `compilation.use_cache`), with the decoders stored as traced
    (`compilation.ProgramStore`): the next call on sentences of the same shapes loads its decoders instead of
    tracing and compiling them again (docs/internals.md#compilation)."""
    from jax_transformer import compilation

    warn = lambda m: print(m, file=sys.stderr)  # noqa: E731
    compilation.use_cache(given(args, "loop").get("compilation_cache"), warn, programs=True)


def evaluation_data_flags(p) -> None:
    """The sentence pairs to evaluate on (default: the run's validation data) and the loss batches' size."""
    from jax_transformer.config import DataConfig

    g = p.add_argument_group("evaluation data (default: the run's validation data)")
    g.add_argument("--src", metavar="FILE", help="source sentences")
    g.add_argument("--tgt", metavar="FILE", help="reference translations, line-aligned with --src")
    g.add_argument("--tsv", metavar="FILE", help="source<TAB>reference lines (instead of --src/--tgt)")
    add_settings(p, DataConfig, "data", "loss batches, language columns", only=("max_tokens", "language_columns"))


def evaluate_flags(sub) -> None:
    e = sub.add_parser(
        "evaluate",
        help="validation loss, perplexity, accuracy, BLEU and chrF of a checkpoint",
        description="Validation loss, perplexity, token accuracy, and sacreBLEU BLEU/chrF (cased, detokenized, "
        "13a) with their signatures, plus the lowercased 13a-tokenized BLEU tutorials report. Several "
        "--beam-size/--alpha values give a table of every combination (beam 1 is greedy; alpha does not apply "
        "to it), to choose the decoding on the validation set.",
    )
    checkpoint_flags(e, compute=True, mesh=True)
    language_flags(e)
    evaluation_data_flags(e)
    compilation_flags(e)
    decoding_flags(e, several=True, more=("samples",))
    e.add_argument(
        "--output",
        metavar="FILE",
        help="also write the translations to FILE, one per line (with several decodings: the best one's)",
    )
    e.set_defaults(func=cmd_evaluate)


def translate_flags(sub) -> None:
    tr = sub.add_parser(
        "translate",
        help="translate lines of text (stdin or --input) to stdout",
        description="Translate UTF-8 text, one sentence per line, to stdout: exactly one output line per input "
        "line (an empty line stays empty; --n-best K gives K lines, or one JSON object with --output-format "
        "jsonl), read and translated in chunks, so input of any size streams through. Every decoding choice is a "
        "flag below (default: what the run stored; an imported model's generation_config). Without --progress / "
        "--no-progress the progress bar shows when stderr is a terminal.",
    )
    checkpoint_flags(tr, compute=True, mesh=True)
    language_flags(tr)
    tr.add_argument("--input", metavar="FILE", help="UTF-8 file with one sentence per line (default: stdin)")
    decoding_flags(tr, more=("progress",))
    compilation_flags(tr)
    tr.add_argument(
        "--input-format",
        choices=("text", "tsv"),
        default="text",
        help="text: a sentence per line; tsv: source<TAB>target prefix, the translation beginning with the prefix "
        "(an empty prefix: none) (default text)",
    )
    tr.add_argument(
        "--output-format",
        choices=("text", "tsv", "jsonl"),
        default="text",
        help="text: each hypothesis on a line (--n-best lines per input line); tsv: line, rank, score, text; "
        "jsonl: a JSON object per input line with every hypothesis, its score, tokens and per-token "
        "log-probs (default text)",
    )
    tr.add_argument(
        "--on-too-long",
        choices=("error", "truncate"),
        default="error",
        help="a line longer than the model's max_len tokens: stop with an error naming the line (after writing "
        "the lines before it), or translate its first max_len - 1 tokens and report the line (default error)",
    )
    tr.add_argument(
        "--max-tokens",
        type=number(int, 1),
        metavar="N",
        help="batch by source tokens: each batch as many sentences (sorted by length) as fit rows x padded width "
        "<= N, all devices together; a sentence wider than N alone is still translated, in the smallest batch "
        "(default: 64 sentences a batch). With --mesh, each batch's rows are split over the mesh's data axis",
    )
    g = tr.add_argument_group("documents (the documents extra: pip install -e '.[documents]')")
    g.add_argument(
        "--document",
        action="store_true",
        help="the input is a document, not a sentence per line: each sentence (sentencex's, within each line) is "
        "replaced by its translation and every space, tab, line break and blank line is kept; a sentence longer "
        "than the model takes is cut into parts at a clause mark or space (reported); lines of any length stream",
    )
    g.add_argument(
        "--document-language",
        metavar="CODE",
        help="the document's language for the sentence splitter, ISO 639-1 (de) or a model's code (deu_Latn, "
        "de_DE) (default: --src-lang of a multilingual model, else en)",
    )
    tr.set_defaults(func=cmd_translate)


def score_flags(sub) -> None:
    sc = sub.add_parser(
        "score",
        help="the log-probability of given translations, per pair and per token (to filter a corpus)",
        description="Score sentence pairs: the log-probability the model gives each target token (EOS included) "
        "given the source, and their sum, as CTranslate2's score_batch. One output line per input line (a pair "
        "with an empty side: an empty record), streamed in chunks.",
    )
    checkpoint_flags(sc, compute=True, mesh=True)
    language_flags(sc)
    g = sc.add_argument_group("pairs")
    g.add_argument("--tsv", metavar="FILE", help="source<TAB>target lines")
    g.add_argument("--src", metavar="FILE", help="source sentences (with --tgt, line-aligned)")
    g.add_argument("--tgt", metavar="FILE", help="target sentences")
    sc.add_argument(
        "--output-format",
        choices=("text", "tsv", "jsonl"),
        default="text",
        help="text: the score; tsv: line, score, token ids, per-token log-probs; jsonl: the same as JSON "
        "(default text)",
    )
    from jax_transformer.config import LoopConfig

    add_settings(sc, LoopConfig, "loop", "output", only=("progress",))
    compilation_flags(sc)
    sc.set_defaults(func=cmd_score)


def export_flags(sub) -> None:
    x = sub.add_parser("export", help="write a checkpoint's weights as a PyTorch file for torch_reference")
    checkpoint_flags(x)
    x.add_argument(
        "--output",
        required=True,
        metavar="FILE",
        help="the file to write: torch.save of {format, config (JSON), state_dict, tokenizer}, or a "
        "safetensors file (no pickle) with the config and tokenizer in its metadata",
    )
    x.add_argument(
        "--format",
        choices=("torch", "safetensors", "transformers", "peft"),
        help="torch or safetensors: a weight file for torch_reference (default: safetensors for a .safetensors name, "
        "torch otherwise); transformers: a directory MarianMTModel (or, for a model imported from FSMT or fairseq, "
        "FSMTForConditionalGeneration; M2M-100/NLLB, mBART as imported) and its tokenizer load with from_pretrained; "
        "peft: a LoRA run's adapters alone, a directory peft.PeftModel.from_pretrained loads on the transformers "
        "model the run was imported from",
    )
    x.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA run's adapters folded into the weights (W + A B alpha / r, peft's merge_and_unload) for "
        "--format transformers, torch or safetensors",
    )
    x.set_defaults(func=cmd_export)


def import_flags(sub) -> None:
    i = sub.add_parser(
        "import",
        help="a pretrained model (a hub name, a transformers directory, a fairseq checkpoint, a peft adapter) as a "
        "run directory",
        description="Reads a transformers save_pretrained directory (MarianMTModel, FSMTForConditionalGeneration, "
        "M2M100ForConditionalGeneration for NLLB-200 and M2M-100, MBartForConditionalGeneration), by path or by its "
        "hub name, a fairseq transformer checkpoint (.pt with dict.<lang>.txt and bpecodes beside it), or a peft "
        "LoRA adapter with its base model, and writes a run directory that translate, evaluate, attention, export, "
        "verify and train --init-from take: its weights, config, tokenizer and how it decodes (transformers' "
        "generate rules).",
    )
    i.add_argument(
        "source",
        metavar="SOURCE",
        help="a transformers save_pretrained directory, a fairseq .pt file, a peft adapter directory, or a hub name "
        "(ORG/NAME, e.g. facebook/nllb-200-distilled-600M) read through huggingface_hub: its local cache with "
        "HF_HUB_OFFLINE=1, a download where there is a network",
    )
    i.add_argument("--revision", metavar="REV", help="of a hub name: a branch, tag or commit (default main)")
    i.add_argument("--output", required=True, metavar="DIR", help="the run directory to write (new or empty)")
    i.add_argument(
        "--base",
        metavar="MODEL",
        help="for a peft LoRA adapter directory as SOURCE: the model it adapts (default: its adapter_config.json's "
        "base_model_name_or_path); the run holds both, and train --init-from goes on training the adapters",
    )
    i.set_defaults(func=cmd_import)


def attention_flags(sub) -> None:
    a = sub.add_parser(
        "attention",
        help="draw the attention weights of a checkpoint on one sentence (PNG)",
        description="Translate one sentence greedily and draw every head's attention as heatmaps.",
    )
    checkpoint_flags(a)
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


def average_flags(sub) -> None:
    av = sub.add_parser(
        "average",
        help="average the parameters of a run's last K checkpoints into a new checkpoint",
        description="The mean of the last K saved checkpoints' parameters (fairseq's average_checkpoints), "
        "written as a run-like directory that evaluate, translate, export, attention and verify read. The "
        "optimiser state is not averaged nor kept (translation does not need it), so the output cannot be "
        "resumed. A run keeps its last --keep checkpoints: train with --keep K or more to average K.",
    )
    av.add_argument("--checkpoint", required=True, metavar="DIR", help="the run directory whose checkpoints to average")
    av.add_argument(
        "--last", required=True, type=number(int, 1), metavar="K", help="how many of the newest saved steps"
    )
    av.add_argument("--output", required=True, metavar="DIR", help="the new directory to write (must not exist)")
    av.set_defaults(func=cmd_average)


def verify_flags(sub) -> None:
    v = sub.add_parser(
        "verify",
        help="cross-framework check of a trained checkpoint against its PyTorch twin on the validation set",
        description="Exports the checkpoint to the PyTorch twin (as `export` does), runs both on the validation "
        "set and prints the largest logit difference under teacher forcing, the share of sentences decoded to "
        "identical tokens (greedy and beam) and each framework's BLEU. Exit code 4 when the logits differ by "
        "more than --logit-tolerance.",
    )
    checkpoint_flags(v, compute=True)
    language_flags(v)
    evaluation_data_flags(v)
    decoding_flags(v, more=("progress",), only=("beam_size", "alpha"))
    v.add_argument(
        "--sentences", type=number(int, 1), metavar="N", help="verify on the first N sentence pairs only (default all)"
    )
    v.add_argument(
        "--device",
        default="cpu",
        help="torch device of the PyTorch twin, e.g. cpu or cuda (default cpu); JAX uses its default backend",
    )
    v.add_argument(
        "--batch-size", type=number(int, 1), default=32, metavar="N", help="sentences per decoding batch (default 32)"
    )
    v.add_argument(
        "--logit-tolerance",
        type=number(float, 0),
        default=1e-4,
        metavar="X",
        help="largest |logit difference| accepted (default 1e-4: float32 in both frameworks differs by summation "
        "order only, ~1e-6 on logits of size ~10; a wrong weight moves logits by 1e-2 or more)",
    )
    v.add_argument(
        "--torch-threads",
        type=number(int, 1),
        default=1,
        metavar="N",
        help="CPU threads of the PyTorch twin (default 1: its reference decoding works one sentence at a time on "
        "small matrices, where more threads mostly wait for each other)",
    )
    v.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    v.set_defaults(func=cmd_verify)


def plot_flags(sub) -> None:
    pl = sub.add_parser(
        "plot",
        help="validation BLEU and loss of several runs against wall-clock minutes, in one PNG",
        description="Reads each run's metrics.jsonl and draws validation BLEU (left) and loss (right) against "
        "wall-clock minutes (resumed commands' time added up), a star for each run's final evaluation.",
    )
    pl.add_argument("--runs", nargs="+", required=True, metavar="DIR", help="run directories (or metrics.jsonl files)")
    pl.add_argument("--labels", nargs="+", metavar="NAME", help="a legend label per run (default: the paths as given)")
    pl.add_argument("--output", default="quality.png", metavar="FILE", help="the PNG to write (default quality.png)")
    pl.set_defaults(func=cmd_plot)


# =============================================================================================================
# The sub-commands
# =============================================================================================================


def _print(text: str = "") -> None:
    print(text, flush=True)


def plan_flags(sub) -> None:
    from jax_transformer.config import PRESETS, REMAT_POLICIES

    pl = sub.add_parser(
        "plan",
        help="the memory a training step needs per device on a mesh, before the run (nothing allocated)",
        description="Compiles the training step ahead of time from abstract shapes on the mesh and prints XLA's "
        "account of its memory per device (arguments, outputs, temporaries) and whether it fits common "
        "accelerators (docs/scaling.md). With --devices: compiled for that many simulated CPU devices (exact "
        "argument and output sizes; the CPU compiler's temporaries); without: for the devices JAX sees.",
    )
    model = pl.add_mutually_exclusive_group()
    model.add_argument("--preset", choices=sorted(PRESETS), help="a preset's shape (default: base)")
    model.add_argument("--init-from", metavar="DIR", help="the model of a run directory (an imported one too)")
    pl.add_argument("--mesh", help="data=D,fsdp=F,tensor=T (as train's --mesh; default: all devices on data)")
    pl.add_argument(
        "--devices", type=number(int, 1), help="simulated CPU devices of the mesh (default: the devices JAX sees)"
    )
    pl.add_argument("--max-tokens", type=number(int, 1), default=4096, help="target tokens per batch (default: 4096)")
    pl.add_argument("--width", type=number(int, 2), help="tokens per row (default: the model's positions, at most 128)")
    pl.add_argument("--accumulate", type=number(int, 1), default=1, help="micro-batches per step (default: 1)")
    pl.add_argument("--dtype", choices=("float32", "bfloat16"), help="compute dtype (default: the model's)")
    pl.add_argument("--remat", choices=REMAT_POLICIES, help="recompute layers in the backward pass (as train's)")
    from jax_transformer.config import LORA_FIELDS, OptimConfig, TransformerConfig

    add_settings(pl, TransformerConfig, "model", "fine-tuning (as train's)", only=(*LORA_FIELDS, "quantize"))
    add_settings(pl, OptimConfig, "optim", "fine-tuning", only=("freeze",))
    pl.set_defaults(func=cmd_plan)


def serve_flags(sub) -> None:
    from jax_transformer.config import ServeConfig

    sv = sub.add_parser(
        "serve",
        help="an HTTP translation service (LibreTranslate's API, a native JSON API with scores) on 127.0.0.1",
        description="Keeps the model and its compiled decoders in one process and answers HTTP requests: "
        "LibreTranslate's POST /translate, GET /languages and POST /detect, so its clients work unchanged; POST "
        "/v1/translate with every decoding option and the scores; GET /health. Requests that arrive within "
        "--batch-window-ms share a batch, up to --max-tokens source tokens. Text is split into sentences with its "
        "layout kept. SIGTERM stops taking requests, finishes those in flight and exits. docs/serving.md.",
    )
    checkpoint_flags(sv, compute=True, mesh=True)
    decoding_flags(sv)
    compilation_flags(sv)
    add_settings(sv, ServeConfig, "serve", "service")
    sv.set_defaults(func=cmd_serve)


def cmd_serve(args, start_time: float) -> int:
    from jax_transformer import inference, service
    from jax_transformer.config import ServeConfig

    settings = ServeConfig.from_dict(given(args, "serve"), source="serve flags")
    use_compilation_cache(args)
    loaded = _load(args)
    decode = inference.decoding(loaded, given(args, "decode"))
    print(f"decoding: {decode.describe()}", file=sys.stderr)
    found = service.build(loaded, decode, settings)
    service.serve(found, print_fn=lambda line: print(line, file=sys.stderr, flush=True))
    return 0


def cmd_plan(args, start_time: float) -> int:
    import os

    if args.devices:  # that many simulated CPU devices: set before JAX starts
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
        os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={args.devices}"])
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    from jax_transformer import plan
    from jax_transformer.config import OptimConfig, preset
    from jax_transformer.errors import UsageError
    from jax_transformer.sharding import MeshShape

    if args.devices and jax.device_count() != args.devices:
        raise UsageError(f"--devices {args.devices}: JAX sees {jax.device_count()} (it started before the flag)")
    if args.init_from:
        from jax_transformer.checkpoint import CheckpointManager, find_checkpoint_dir
        from jax_transformer.config import TransformerConfig

        manager = CheckpointManager(find_checkpoint_dir(args.init_from), read_only=True)
        config = TransformerConfig.from_dict(manager.read_meta("latest")["config"], source=args.init_from)
    else:
        config = preset(args.preset or "base")
    config = config.replace(**{k: getattr(args, k) for k in ("dtype", "remat") if getattr(args, k)})
    config = config.replace(**given(args, "model"))  # the LoRA flags
    optim = OptimConfig(**given(args, "optim"))
    n = args.devices or jax.device_count()
    mesh = MeshShape.parse(args.mesh, n)
    width = args.width or min(config.max_len, 128)
    rows = plan.rows_for(args.max_tokens, width, mesh.batch_devices * args.accumulate)
    _print(plan.describe(plan.plan_step(config, optim, mesh, rows, width, args.accumulate), config, optim))
    return 0


def cmd_train(args, start_time: float) -> int:
    from jax_transformer import host_memory

    if args.keep_freed_memory:  # before JAX starts its threads; only where JAX computes on the CPU
        host_memory.keep_freed_memory()
    from jax_transformer import run

    result = run.train(
        run_dir=args.run_dir,
        resume=args.resume,
        strict_resume=args.strict_resume,
        init_from_torch=args.init_from_torch,
        preset_name=args.preset,
        seed=args.seed,
        recipe=args.recipe,
        init_from=args.init_from,
        start_time=start_time,
        print_fn=_print,
        **{group: given(args, group) for group in ("model", "data", "optim", "loop", "parallel", "decode")},
    )
    _print(
        f"done: step {result.step} ({result.stopped_by}), {(time.time() - start_time) / 60:.1f} minutes; "
        f"checkpoints in {result.checkpoint_dir}; best step {result.best_step} ({result.best_by}), the one evaluate, "
        f"translate and export use by default"
    )
    if result.curve is not None:
        _print(f"loss curve: {result.curve}")
    if result.stopped_by.startswith("SIG"):
        import signal

        return 128 + int(getattr(signal, result.stopped_by))
    return 0


def _load(args, quantize_weights: bool = True, merge_adapters: bool = True):
    """The checkpoint as --checkpoint/--step, --dtype / --attention-kernel / --quantize, --mesh and --src-lang /
    --tgt-lang ask, where the sub-command has them (`inference.load`)."""
    from jax_transformer import inference

    languages = {k: v for k, v in given(args, "data").items() if k in ("src_lang", "tgt_lang")}
    return inference.load(
        args.checkpoint,
        args.step,
        compute=given(args, "model"),
        quantize_weights=quantize_weights,
        mesh=given(args, "parallel").get("mesh"),
        languages=languages,
        print_fn=lambda line: print(line, file=sys.stderr),
        merge_adapters=merge_adapters,
    )


def _evaluation_data(args, loaded, limit: int | None = None):
    """The sentences to evaluate on (--src/--tgt or --tsv, else the run's validation data) as a ValidationSet;
    `limit`: the first this many pairs only."""
    from jax_transformer import run
    from jax_transformer.batching import ValidationSet, encode_corpus
    from jax_transformer.checks import check_batch
    from jax_transformer.config import DataConfig

    if args.src or args.tgt or args.tsv:
        columns = given(args, "data").get("language_columns", False)
        files = DataConfig(src=args.src, tgt=args.tgt, tsv=args.tsv, language_columns=columns)
        corpus = run.load_corpus(files, "train")  # the given files, read as a training corpus is
    else:
        corpus = run.load_corpus(DataConfig.from_dict(run.stored_settings(loaded)["data"]), "valid")
        if corpus is None:
            raise run.UsageError("the run had no validation data: give --src/--tgt or --tsv")
    if limit is not None:
        corpus = dataclasses.replace(
            corpus,
            sources=corpus.sources[:limit],
            targets=corpus.targets[:limit],
            line_numbers=corpus.line_numbers[:limit],
            languages=None if corpus.languages is None else corpus.languages[:limit],
        )
    encoded = encode_corpus(corpus, loaded.tokenizer, loaded.config.max_len, on_too_long="skip")
    print(f"evaluation data: {corpus.describe()}; {encoded.describe()}", file=sys.stderr)
    max_tokens = given(args, "data").get("max_tokens", DataConfig().max_tokens)
    valid = ValidationSet.from_encoded(encoded, corpus, max_tokens)
    for i, batch in enumerate(valid.batches):
        check_batch(batch, loaded.config, f"evaluation batch {i}")
    return valid


def cmd_evaluate(args, start_time: float) -> int:
    from jax_transformer import evaluation, inference, training
    from jax_transformer.config import LoopConfig

    use_compilation_cache(args)
    loaded = _load(args)
    valid = _evaluation_data(args, loaded)
    eval_step = training.make_eval_step(loaded.config, loaded.optim.get("label_smoothing", 0.1))
    result = {"step": loaded.step, **training.evaluate_loss(loaded.params, eval_step, valid.batches)}
    _print(
        f"step {loaded.step}: loss {result['loss']:.3f}, perplexity {result['ppl']:.2f}, token accuracy "
        f"{100 * result['accuracy']:.1f}% ({len(valid.sources)} sentences)"
    )
    rows, outputs = [], []
    for decode in inference.decodings(loaded, given(args, "decode")):
        print(f"decoding: {decode.describe()}", file=sys.stderr)
        began = time.time()
        scores, hypotheses = evaluation.evaluate_translations(
            loaded.params,
            loaded.config,
            loaded.tokenizer,
            valid.sources,
            valid.references,
            decode.replace(n_best=1),
            languages=valid.languages,
        )
        row = {**scores, "beam_size": decode.beam_size, "alpha": decode.alpha}
        rows.append({**row, "seconds": round(time.time() - began, 1)})
        outputs.append(hypotheses)
    best = max(range(len(rows)), key=lambda i: rows[i]["bleu"])
    hypotheses = outputs[best]
    samples = given(args, "loop").get("samples", LoopConfig().samples)
    for i in evaluation.spread_indices(len(hypotheses), samples):
        _print(f"  source:    {valid.sources[i]}\n  reference: {valid.references[i]}\n  model:     {hypotheses[i]}")
    if len(rows) == 1:
        row = rows[0]
        _print(
            f"BLEU {row['bleu']:.2f}, chrF {row['chrf']:.2f} (beam {row['beam_size']}, alpha {row['alpha']:g}); "
            f"lowercased 13a-tokenized BLEU {row['bleu_lc']:.2f}"
        )
        if pairs := evaluation.describe_pairs(row):
            _print(f"per language pair: {pairs}")
    else:
        _print("| beam | alpha | BLEU | chrF | BLEU lowercased | seconds |\n|---:|---:|---:|---:|---:|---:|")
        for i, row in enumerate(rows):
            alpha = "-" if row["beam_size"] == 1 else f"{row['alpha']:g}"  # greedy has no length penalty
            mark = " (best)" if i == best else ""
            _print(
                f"| {row['beam_size']} | {alpha} | {row['bleu']:.2f}{mark} | {row['chrf']:.2f} | "
                f"{row['bleu_lc']:.2f} | {row['seconds']:.1f} |"
            )
    _print(f"sacreBLEU signatures: BLEU {rows[0]['bleu_signature']}; chrF {rows[0]['chrf_signature']}")
    _print(f"lowercased BLEU: {rows[0]['bleu_lc_signature']}")
    if args.output:  # the translations of the best row
        from jax_transformer import files

        files.write_text(args.output, "".join(h + "\n" for h in hypotheses))
    result["sentences"] = len(valid.sources)
    if len(rows) == 1:
        result.update({k: v for k, v in rows[0].items() if k != "seconds"})
    else:
        result.update(sweep=rows, best={k: rows[best][k] for k in ("beam_size", "alpha", "bleu", "chrf")})
    _print(json.dumps(result))
    return 0


def cmd_translate(args, start_time: float) -> int:
    from jax_transformer import inference
    from jax_transformer.corpus import count_lines, read_lines
    from jax_transformer.translation import OutputLines, translate_lines

    if args.document:  # refused before the model loads
        from jax_transformer import documents
        from jax_transformer.run import UsageError

        flags = {"--output-format": args.output_format, "--input-format": args.input_format}
        for flag, value in flags.items():
            if value != "text":
                raise UsageError(f"--document writes the document, translated, as text: it takes no {flag} {value}")
        n_best = given(args, "decode").get("n_best", 1)
        if n_best > 1:
            raise UsageError(f"--document writes one translation of each sentence: it takes no --n-best {n_best}")
        documents.Segmenter()  # a UsageError naming the documents extra where sentencex is missing
    use_compilation_cache(args)
    loaded = _load(args)
    decode = inference.decoding(loaded, given(args, "decode"))
    print(f"decoding: {decode.describe()}", file=sys.stderr)
    if args.document:
        if decode.n_best > 1:  # the run's stored choice
            raise UsageError(f"--document writes one translation of each sentence: the run's --n-best {decode.n_best} "
                             f"needs --n-best 1")  # fmt: skip
        language = args.document_language or getattr(loaded.tokenizer, "src_lang", None)  # None: English
        segmenter = documents.Segmenter(language, documents.model_fits(loaded.tokenizer, loaded.config))
        origin = args.input or "stdin"
        sys.stdout.flush()  # what was printed before goes first; the translation bypasses Python's buffer
        fd = _fileno(sys.stdout)
        try:
            report = documents.translate_document(
                loaded.params,
                loaded.config,
                loaded.tokenizer,
                documents.read_blocks(args.input or sys.stdin.buffer, origin=origin),
                sys.stdout.write if fd is None else documents.OutputText(fd),
                decode,
                segmenter=segmenter,
                origin=origin,
                progress=given(args, "loop").get("progress"),  # None: when stderr is a terminal
                max_tokens=args.max_tokens,  # None: TRANSLATE_BATCH_SIZE sentences a batch
            )
        finally:
            sys.stdout.flush()
        print(report.describe(), file=sys.stderr)
        return 0
    # Read, translated and written a chunk of lines at a time: memory does not grow with the input.
    if args.input:
        origin, lines, total = args.input, read_lines(args.input), count_lines(args.input)
    else:
        origin, lines, total = "stdin", read_lines(sys.stdin.buffer, origin="stdin"), None
    sys.stdout.flush()  # what was printed before goes first; the translations bypass Python's buffer
    fd = _fileno(sys.stdout)
    write = print if fd is None else OutputLines(fd)  # UTF-8 whatever the locale says
    try:
        report = translate_lines(
            loaded.params,
            loaded.config,
            loaded.tokenizer,
            (text for _, text in lines),
            write,
            decode,
            origin=origin,
            on_too_long=args.on_too_long,
            total=total,
            progress=given(args, "loop").get("progress"),  # None: when stderr is a terminal
            output_format=args.output_format,
            prefix_column=args.input_format == "tsv",
            max_tokens=args.max_tokens,  # None: TRANSLATE_BATCH_SIZE sentences a batch
        )
    finally:
        sys.stdout.flush()
    print(report.describe(), file=sys.stderr)
    return 0


def cmd_score(args, start_time: float) -> int:
    from jax_transformer.corpus import PairReader
    from jax_transformer.run import UsageError
    from jax_transformer.scoring import score_lines
    from jax_transformer.translation import OutputLines

    if not args.tsv and not (args.src and args.tgt):
        raise UsageError("score: give --tsv FILE (source<TAB>target lines), or --src FILE and --tgt FILE")
    use_compilation_cache(args)
    loaded = _load(args)
    reader = PairReader([args.tsv] if args.tsv else [args.src, args.tgt])
    sys.stdout.flush()  # what was printed before goes first; the scores bypass Python's buffer
    fd = _fileno(sys.stdout)
    write = print if fd is None else OutputLines(fd)
    try:
        count = score_lines(
            loaded.params,
            loaded.config,
            loaded.tokenizer,
            reader,
            write,
            origin=args.tsv or args.src,
            output_format=args.output_format,
            progress=given(args, "loop").get("progress"),
        )
    finally:
        sys.stdout.flush()
    print(f"scored {count} pairs; {reader.describe()}", file=sys.stderr)
    return 0


def _fileno(stream) -> int | None:
    """The file descriptor behind a stream; None for one without (a test's io.StringIO)."""
    try:
        return stream.fileno()
    except (OSError, AttributeError, ValueError):
        return None


def cmd_export(args, start_time: float) -> int:
    from jax_transformer import export
    from jax_transformer.run import UsageError

    loaded = _load(args, merge_adapters=args.format != "peft" and args.merge_lora)
    if args.format == "peft":
        from jax_transformer import hub, run

        path = hub.export_peft(loaded.params, loaded.config, run.stored_settings(loaded), args.output)
        _print(
            f"wrote {path}: the LoRA adapters of step {loaded.step} (rank {loaded.config.lora_rank}) for "
            f"peft.PeftModel.from_pretrained"
        )
        return 0
    if loaded.config.lora_rank:
        raise UsageError(
            "this run has LoRA adapters: --merge-lora folds them into the weights, --format peft writes them alone"
        )
    if args.format == "transformers":
        from jax_transformer import hub, run

        settings = run.stored_settings(loaded)
        path, kind = hub.export_transformers(loaded.params, loaded.config, loaded.tokenizer, settings, args.output)
        model = {
            "marian": "MarianMTModel",
            "fsmt": "FSMTForConditionalGeneration",
            "m2m_100": "M2M100ForConditionalGeneration",
            "mbart": "MBartForConditionalGeneration",
        }[kind]
        _print(f"wrote {path}: step {loaded.step} as a transformers {model} with its tokenizer (from_pretrained)")
        return 0
    path = export.export_weights(args.output, loaded.params, loaded.config, loaded.tokenizer, format=args.format)
    _print(f"wrote {path}: the torch_reference state_dict of step {loaded.step} with its config and tokenizer")
    return 0


def cmd_import(args, start_time: float) -> int:
    from jax_transformer import hub

    path = hub.import_model(args.source, args.output, print_fn=_print, base=args.base, revision=args.revision)
    _print(f"wrote {path}: translate, evaluate, export and train --init-from take it")
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


def cmd_average(args, start_time: float) -> int:
    from jax_transformer.averaging import average_checkpoints
    from jax_transformer.run import UsageError

    try:
        output, step, steps = average_checkpoints(args.checkpoint, args.last, args.output, print_fn=_print)
    except ValueError as e:
        raise UsageError(str(e)) from None
    _print(
        f"wrote {output}: the mean of the parameters of steps {steps} (no optimiser state: for evaluate, translate, "
        f"export, attention and verify, not for --resume), saved as step {step}"
    )
    return 0


def cmd_verify(args, start_time: float) -> int:
    from jax_transformer import inference
    from jax_transformer.run import UsageError
    from jax_transformer.verify import verify

    if args.device != "cpu":
        import torch

        try:
            torch.empty(1, device=args.device)
        except (RuntimeError, AssertionError) as e:
            raise UsageError(f"--device {args.device}: not usable here ({e})") from None
    import torch

    # One thread by default: under load, torch's threads fight XLA's for the cores (docs/internals.md#verify).
    torch.set_num_threads(args.torch_threads)
    loaded = _load(args, quantize_weights=False)
    decode = inference.decoding(loaded, given(args, "decode"))  # its beam width and alpha, by this project's rules
    valid = _evaluation_data(args, loaded, limit=args.sentences)
    report = verify(
        loaded,
        valid.batches,
        valid.sources,
        valid.references,
        decode,
        batch_size=args.batch_size,
        device=args.device,
        progress=given(args, "loop").get("progress", True),
        print_fn=lambda line: print(line, file=sys.stderr),
    )
    _print(report.table())
    if args.json:
        from jax_transformer import files

        files.write_text(args.json, json.dumps(report.to_dict(), indent=1) + "\n")
    if not report.logit_max_abs_diff <= args.logit_tolerance:
        print(
            f"error: the frameworks differ: largest logit difference {report.logit_max_abs_diff:.3e} > "
            f"--logit-tolerance {args.logit_tolerance:g}",
            file=sys.stderr,
        )
        return EXIT_NOT_VERIFIED
    _print(f"verified: logits agree within {args.logit_tolerance:g}")
    return 0


def cmd_plot(args, start_time: float) -> int:
    from jax_transformer.errors import DataError
    from jax_transformer.visualize import plot_runs

    try:
        path, curves = plot_runs(args.runs, args.output, args.labels)
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"plot: {e}") from None
    for curve in curves:
        final = curve.final
        last = f"; final BLEU {final['bleu']:.2f} at {final['minutes']:.1f} min" if final and "bleu" in final else ""
        _print(f"{curve.label}: {len(curve.minutes)} evaluations{last}")
    _print(f"wrote {path}")
    return 0


def _stdout_closed() -> bool:
    """stdout is a pipe whose reader has gone (poll reports an error on it)."""
    import select

    fd = _fileno(sys.stdout)
    if fd is None:
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poll.poll(0))


def _discard_stdout() -> None:
    """stdout's descriptor pointed at /dev/null, so that what is still buffered for a closed pipe goes nowhere at
    exit (instead of a second BrokenPipeError there)."""
    import os

    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)


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
    from jax_transformer.errors import DataError
    from jax_transformer.loop import TrainingError
    from jax_transformer.port import PortError
    from jax_transformer.run import UsageError

    try:
        return args.func(args, start_time)
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    except (DataError, ConfigError, CheckpointError, PortError, UsageError, TokenError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError as e:
        if not _stdout_closed():  # another pipe or socket (a peer process): an error like any other
            print(f"error: {e}", file=sys.stderr)
            return EXIT_ERROR
        _discard_stdout()  # the reader of stdout went away (`| head`): end quietly, as Unix tools do
        return EXIT_BROKEN_PIPE
    except OSError as e:  # the machine's, not the program's: a full disk, a missing permission
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:  # before or after the training loop, which handles Ctrl-C itself
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
