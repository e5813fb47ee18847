"""The log-probability of given translations (`score`)."""

from __future__ import annotations

import sys

from jax_transformer.cli import flags, output


def add(sub) -> None:
    sc = sub.add_parser(
        "score",
        help="the log-probability of given translations, per pair and per token (to filter a corpus)",
        description="Score sentence pairs: the log-probability the model gives each target token (EOS included) "
        "given the source, and their sum, as CTranslate2's score_batch. One output line per input line (a pair "
        "with an empty side: an empty record), streamed in chunks.",
    )
    flags.checkpoint_flags(sc, compute=True, mesh=True)
    flags.language_flags(sc)
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
    sc.add_argument(
        "--on-too-long",
        choices=("error", "skip"),
        default="error",
        help="a pair with a side longer than the model's max_len tokens: stop with an error naming the line (after "
        "writing the lines before it), or write an empty record in its place, as for a pair with an empty side, and "
        "name the line in the report (default error)",
    )
    from jax_transformer.settings.config import DecodeConfig, LoopConfig

    flags.add_settings(sc, LoopConfig, "loop", "output", only=("progress",))
    flags.add_settings(sc, DecodeConfig, "decode", "word alignments", only=("alignments", "alignment_layer"))
    flags.compilation_flags(sc)
    sc.set_defaults(func=run)


def run(args, start_time: float) -> int:
    from jax_transformer.data.corpus import PairReader
    from jax_transformer.decoding.translation import OutputLines
    from jax_transformer.decoding.translator import Translator
    from jax_transformer.errors import UsageError
    from jax_transformer.settings.config import DecodeConfig

    if args.tsv and (args.src or args.tgt):
        given = " and ".join(flag for flag, value in (("--src", args.src), ("--tgt", args.tgt)) if value)
        raise UsageError(f"score: --tsv {args.tsv} holds the pairs; it takes no {given} (give one or the other)")
    if not args.tsv and not (args.src and args.tgt):
        raise UsageError("score: give --tsv FILE (source<TAB>target lines), or --src FILE and --tgt FILE")
    flags.use_compilation_cache(args)
    # Scoring decodes nothing: of the decoding choices, only the word alignments apply.
    decode = DecodeConfig(**flags.given(args, "decode"))
    if decode.alignments and args.output_format == "text":
        raise UsageError("score: --alignments needs --output-format tsv or jsonl (text output is the score alone)")
    translator = Translator.of(flags.load(args), decode)
    reader = PairReader([args.tsv] if args.tsv else [args.src, args.tgt])
    sys.stdout.flush()  # what was printed before goes first; the scores bypass Python's buffer
    fd = output.fileno(sys.stdout)
    write = print if fd is None else OutputLines(fd)
    try:
        report = translator.score_lines(
            reader,
            write,
            origin=args.tsv or args.src,
            output_format=args.output_format,
            progress=flags.given(args, "loop").get("progress"),
            on_too_long=args.on_too_long,
            alignment_layer=decode.aligned_layer(translator.config),
        )
    finally:
        sys.stdout.flush()
    print(f"{report.describe()}; {reader.describe()}", file=sys.stderr)
    return 0
