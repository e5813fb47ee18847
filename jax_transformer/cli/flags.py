"""The command line's flags, built from the settings' fields (one flag per field, named after it: `TransformerConfig.
d_model` is `--d-model`, declared once, in `jax_transformer.settings.config`), the groups sub-commands share, and
their readers: `given` (the flags of a group that were given), `load` (the checkpoint the flags name) and
`evaluation_data`."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import typing

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
        metavar = None if choices else field.metadata.get("metavar") or {int: "N", float: "X"}.get(types[0], "TEXT")
        nargs = "+" if field.name in several else None
        kind = types[0] if choices else setting_type(cls, field, types[0])
        section.add_argument(
            flag, *ALIASES.get(field.name, []), type=kind, metavar=metavar, choices=choices, nargs=nargs, **options
        )


def setting_type(cls, field, kind):
    """The argparse type of a settings flag: the value parsed as `kind`, then checked as its settings group checks
    the field (`config.check_field`: range, finiteness), so that a bad value is a parse error naming the flag, in
    every sub-command alike, before a file is read or JAX starts."""
    from jax_transformer.settings.config import check_field

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


def checkpoint_flags(
    p, *, compute: bool = False, mesh: bool = False, required: bool = True, ensemble: bool = False
) -> None:
    """--checkpoint and --step; with `compute`, how to compute (--dtype, --attention-kernel: TransformerConfig's);
    with `mesh`, --mesh: the weights read straight onto a mesh of the devices, split as training splits them.
    `required`: False where the sub-command can name its checkpoints otherwise (serve --models). With `ensemble`,
    --checkpoint may be repeated (an ensemble of the runs: `decoding.ensemble`) and --ensemble-weights weighs them."""
    from jax_transformer.settings.config import COMPUTE_FIELDS, ParallelConfig, TransformerConfig

    p.add_argument(
        "--checkpoint",
        required=required,
        metavar="DIR",
        action="append" if ensemble else "store",
        help="run directory (or its checkpoints/ folder) of a training"
        + ("; repeated, an ensemble of the runs (their next-token probabilities averaged at every step; they must "
           "share the vocabulary; decoding as the first run stored)" if ensemble else ""),
    )  # fmt: skip
    if ensemble:
        p.add_argument(
            "--ensemble-weights",
            type=number(float, 0),
            nargs="+",
            metavar="X",
            help="an ensemble's weights, one per --checkpoint, in order (normalised to sum to 1; default: equal)",
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
    from jax_transformer.settings.config import DataConfig

    add_settings(p, DataConfig, "data", "languages", only=("src_lang", "tgt_lang"), default="the tokenizer's")


def decoding_flags(
    p, *, several: bool = False, more: tuple[str, ...] = (), only: tuple[str, ...] | None = None
) -> None:
    """Every decoding choice (DecodeConfig's fields, or the `only` ones; default: what the checkpoint stored) and
    the `more` LoopConfig fields named; with `several`, --beam-size and --alpha take lists."""
    from jax_transformer.settings.config import DecodeConfig, LoopConfig

    lists = ("beam_size", "alpha") if several else ()
    add_settings(p, DecodeConfig, "decode", "decoding", only=only, several=lists, default="the run's")
    if more:
        add_settings(p, LoopConfig, "loop", "output", only=more)


def compilation_flags(p) -> None:
    """--compilation-cache (LoopConfig's): where the programs of a sub-command that decodes are kept for the next."""
    from jax_transformer.settings.config import LoopConfig

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
    from jax_transformer.settings.config import DataConfig

    g = p.add_argument_group("evaluation data (default: the run's validation data)")
    g.add_argument("--src", metavar="FILE", help="source sentences")
    g.add_argument("--tgt", metavar="FILE", help="reference translations, line-aligned with --src")
    g.add_argument("--tsv", metavar="FILE", help="source<TAB>reference lines (instead of --src/--tgt)")
    add_settings(p, DataConfig, "data", "loss batches, language columns", only=("max_tokens", "language_columns"))


def load(args, quantize_weights: bool = True, merge_adapters: bool = True, directory: str | None = None):
    """The checkpoint as --checkpoint/--step, --dtype / --attention-kernel / --quantize, --mesh and --src-lang /
    --tgt-lang ask, where the sub-command has them (`loading.load`); `directory`: another run's (an ensemble's
    member), read the same way; default: the first --checkpoint."""
    from jax_transformer.decoding import loading

    languages = {k: v for k, v in given(args, "data").items() if k in ("src_lang", "tgt_lang")}
    return loading.load(
        directory or checkpoints(args)[0],
        args.step,
        compute=given(args, "model"),
        quantize_weights=quantize_weights,
        mesh=given(args, "parallel").get("mesh"),
        languages=languages,
        print_fn=lambda line: print(line, file=sys.stderr),
        merge_adapters=merge_adapters,
    )


def checkpoints(args) -> list[str]:
    """The run directories --checkpoint names: one, or an ensemble's (repeated)."""
    return [args.checkpoint] if isinstance(args.checkpoint, str) else list(args.checkpoint)


def ensemble(args, loaded):
    """The ensemble of the checkpoints the flags name (`loading.ensemble`; `loaded`: the first, loaded already),
    weighted by --ensemble-weights; None for one checkpoint (where --ensemble-weights is refused)."""
    from jax_transformer.decoding import loading
    from jax_transformer.errors import UsageError

    paths, weights = checkpoints(args), getattr(args, "ensemble_weights", None)
    if len(paths) == 1:
        if weights is not None:
            raise UsageError("--ensemble-weights weighs an ensemble: give --checkpoint two or more times")
        return None
    if weights is not None and len(weights) != len(paths):
        raise UsageError(f"--ensemble-weights: {len(weights)} weights for {len(paths)} --checkpoint runs")
    members = [loaded] + [load(args, directory=path) for path in paths[1:]]
    return loading.ensemble(members, weights)


def translator(args):
    """The front door (`decoding.translator.Translator`) of the checkpoint the flags name (or the ensemble of the
    checkpoints), decoding as the decoding flags say over the (first) run's stored choice; the decoding is said on
    stderr."""
    from jax_transformer.decoding import loading
    from jax_transformer.decoding.translator import Translator
    from jax_transformer.settings.config import check_decoding

    loaded = load(args)
    decode = loading.decoding(loaded, given(args, "decode"))
    found = ensemble(args, loaded)
    if found is not None:  # against the ensemble's limits too (the shortest max_len)
        check_decoding(found.config, decode, {"--beam-size": [decode.beams]})
    print(f"decoding: {decode.describe()}", file=sys.stderr)
    return Translator.of(loaded, decode, found)


def evaluation_data(args, loaded, limit: int | None = None):
    """The sentences to evaluate on (--src/--tgt or --tsv, else the run's validation data) as a ValidationSet;
    `limit`: the first this many pairs only."""
    from jax_transformer.checkpoint.settings import stored_settings
    from jax_transformer.checks import check_batch
    from jax_transformer.data.batching import ValidationSet, encode_corpus
    from jax_transformer.data.reading import load_corpus
    from jax_transformer.errors import UsageError
    from jax_transformer.settings.config import DataConfig

    if args.src or args.tgt or args.tsv:
        columns = given(args, "data").get("language_columns", False)
        files = DataConfig(src=args.src, tgt=args.tgt, tsv=args.tsv, language_columns=columns)
        corpus = load_corpus(files, "train")  # the given files, read as a training corpus is
    else:
        corpus = load_corpus(DataConfig.from_dict(stored_settings(loaded)["data"]), "valid")
        if corpus is None:
            raise UsageError("the run had no validation data: give --src/--tgt or --tsv")
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
