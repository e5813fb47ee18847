"""Translate lines or a document, streamed (`translate`)."""

from __future__ import annotations

import sys

from jax_transformer.cli import flags, output


def add(sub) -> None:
    tr = sub.add_parser(
        "translate",
        help="translate lines of text (stdin or --input) to stdout",
        description="Translate UTF-8 text, one sentence per line, to stdout: exactly one output line per input "
        "line (an empty line stays empty; --n-best K gives K lines, or one JSON object with --output-format "
        "jsonl), read and translated in chunks, so input of any size streams through. Every decoding choice is a "
        "flag below (default: what the run stored; an imported model's generation_config). Without --progress / "
        "--no-progress the progress bar shows when stderr is a terminal.",
    )
    flags.checkpoint_flags(tr, compute=True, mesh=True, ensemble=True)
    flags.language_flags(tr)
    tr.add_argument("--input", metavar="FILE", help="UTF-8 file with one sentence per line (default: stdin)")
    flags.decoding_flags(tr, more=("progress",))
    flags.compilation_flags(tr)
    tr.add_argument(
        "--input-format",
        choices=("text", "tsv", "jsonl", "html", "xml"),
        default="text",
        help="text: a sentence per line; tsv: source<TAB>target prefix, the translation beginning with the prefix "
        '(an empty prefix, or a line without a tab: none); jsonl: a JSON object a line, with "source" and '
        'optionally "prefix" and "constraints" (a list of phrases the translation must hold); html, xml: a '
        "document of markup, translated block by block as --document translates text, its inline tags placed by "
        "word alignments and every byte outside the translated text kept (default text)",
    )
    tr.add_argument(
        "--constraints",
        action="store_true",
        help="each line is source<TAB>phrase<TAB>phrase... (fairseq's format): every translation holds its line's "
        "phrases (--constraint-order: in any order, or in the order given); beam search only, at most one phrase "
        "per beam; a bad phrase is an error naming the line before anything is translated",
    )
    tr.add_argument(
        "--glossary",
        metavar="FILE",
        help="a glossary, lines of 'source term<TAB>target term': where a source term occurs in a sentence (whole "
        "words, any case), the translation holds its target term (a constraint, as --constraints; with --document "
        "too)",
    )
    tr.add_argument(
        "--output-format",
        choices=("text", "tsv", "jsonl"),
        default="text",
        help="text: each hypothesis on a line (--n-best lines per input line); tsv: line, rank, score, text, a row "
        "per hypothesis (an empty line: one row of its line number), and with --alignments its word alignment; "
        "jsonl: a JSON object per input line with every hypothesis, its score, tokens and per-token log-probs (and "
        'its "alignment") (default text)',
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
        type=flags.number(int, 1),
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
    m = tr.add_argument_group("markup (--input-format html or xml)")
    m.add_argument(
        "--keep-attributes",
        action="store_true",
        help="leave the alt, title and placeholder attributes as they are (default: translated, as the web's "
        "translators do; XML's are always left)",
    )
    m.add_argument(
        "--inline-elements",
        type=_names,
        metavar="A,B",
        help="XML: the elements placed inside a sentence by alignment; any other element ends a block (default "
        "XLIFF's g,x,bx,ex,ph,mrk)",
    )
    m.add_argument(
        "--opaque-elements",
        type=_names,
        metavar="A,B",
        help="XML: inline elements carried whole, their content untouched (default XLIFF's ph,bpt,ept,it); HTML's "
        'are code, kbd, samp, var and any element with translate="no" or class="notranslate"',
    )
    m.add_argument(
        "--target-language",
        metavar="CODE",
        help="the code a lang attribute (xml:lang in XML) is set to (default: --tgt-lang of a multilingual model "
        "as ISO 639-1, else lang attributes are kept, and reported)",
    )
    tr.set_defaults(func=run)


def _names(value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if not names:
        raise ValueError(value)
    return names


def run(args, start_time: float) -> int:
    from jax_transformer.data.corpus import count_lines, read_lines
    from jax_transformer.decoding.translation import OutputLines

    if args.input_format in ("html", "xml"):
        return run_markup(args)

    if args.constraints and args.input_format != "text":  # refused before the model loads
        from jax_transformer.errors import UsageError

        raise UsageError(
            f"--constraints reads source<TAB>phrase... lines: it takes no --input-format {args.input_format} (a "
            f"prefix and constraints together: --input-format jsonl)"
        )
    glossary = None
    if args.glossary:  # read before the model loads: a bad line is an error naming it
        from jax_transformer.decoding.glossary import Glossary

        glossary = Glossary.read(args.glossary)
    if args.document and args.constraints:
        from jax_transformer.errors import UsageError

        raise UsageError("--document translates running text: it takes no --constraints")
    if args.document:  # refused before the model loads
        from jax_transformer.decoding import documents
        from jax_transformer.errors import UsageError

        for flag, value in {"--output-format": args.output_format, "--input-format": args.input_format}.items():
            if value != "text":
                raise UsageError(f"--document writes the document, translated, as text: it takes no {flag} {value}")
        n_best = flags.given(args, "decode").get("n_best", 1)
        if flags.given(args, "decode").get("alignments"):
            raise UsageError("--document writes the document, translated, as text: it takes no --alignments")
        if n_best > 1:
            raise UsageError(f"--document writes one translation of each sentence: it takes no --n-best {n_best}")
        documents.Segmenter()  # a UsageError naming the documents extra where sentencex is missing
    if flags.given(args, "decode").get("alignments") and args.output_format == "text":  # refused before loading
        from jax_transformer.errors import UsageError

        raise UsageError(
            "--alignments writes each hypothesis's word pairs beside it: give --output-format tsv (a fifth column) "
            'or jsonl (an "alignment" field)'
        )
    flags.use_compilation_cache(args)
    translator = flags.translator(args)
    progress = flags.given(args, "loop").get("progress")  # None: when stderr is a terminal
    sys.stdout.flush()  # what was printed before goes first; the translations bypass Python's buffer
    fd = output.fileno(sys.stdout)
    if args.document:
        from jax_transformer.decoding.documents import OutputText

        if translator.decode.n_best > 1:  # the run's stored choice
            raise UsageError(
                f"--document writes one translation of each sentence: the run's --n-best {translator.decode.n_best} "
                f"needs --n-best 1"
            )
        try:
            report = translator.translate_stream(
                args.input or sys.stdin.buffer,
                sys.stdout.write if fd is None else OutputText(fd),
                **_document_options(args, translator, glossary),
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
    input_format = "constraints" if args.constraints else args.input_format
    if args.input and (input_format in ("constraints", "jsonl") or glossary):  # every line checked first
        from jax_transformer.decoding.translation import check_lines

        check_lines(translator.config, translator.tokenizer, (text for _, text in read_lines(args.input)),
                    translator.decode, origin=origin, input_format=input_format, glossary=glossary)  # fmt: skip
    write = print if fd is None else OutputLines(fd)  # UTF-8 whatever the locale says
    try:
        report = translator.translate_lines(
            (text for _, text in lines),
            write,
            origin=origin,
            on_too_long=args.on_too_long,
            total=total,
            progress=progress,
            output_format=args.output_format,
            input_format=input_format,
            glossary=glossary,
            max_tokens=args.max_tokens,  # None: TRANSLATE_BATCH_SIZE sentences a batch
        )
    finally:
        sys.stdout.flush()
    print(report.describe(), file=sys.stderr)
    return 0


def run_markup(args) -> int:
    """--input-format html or xml: the document translated with its markup kept, written as it goes."""
    from jax_transformer.decoding import documents, markup
    from jax_transformer.errors import UsageError

    given = flags.given(args, "decode")
    markup.check_usage(args.input_format, args.output_format, given.get("n_best", 1))  # before the model loads
    if args.constraints:
        raise UsageError(f"--input-format {args.input_format} translates running text: it takes no --constraints")
    if given.get("alignments"):
        raise UsageError(f"--input-format {args.input_format} writes the document: it takes no --alignments (they "
                         f"place its tags)")  # fmt: skip
    if args.input_format == "html" and (args.inline_elements or args.opaque_elements):
        raise UsageError("--inline-elements and --opaque-elements name XML elements: HTML's are fixed")
    documents.Segmenter()  # a UsageError naming the documents extra where sentencex is missing
    glossary = None
    if args.glossary:
        from jax_transformer.decoding.glossary import Glossary

        glossary = Glossary.read(args.glossary)
    flags.use_compilation_cache(args)
    translator = flags.translator(args)
    sys.stdout.flush()
    fd = output.fileno(sys.stdout)
    write = (lambda text: sys.stdout.buffer.write(markup.write_bytes(text))) if fd is None else markup.OutputBytes(fd)
    try:
        report = translator.translate_markup_stream(
            args.input or sys.stdin.buffer,
            write,
            xml=args.input_format == "xml",
            keep_attributes=args.keep_attributes,
            inline_elements=args.inline_elements,
            opaque_elements=args.opaque_elements,
            target_language=args.target_language,
            **_document_options(args, translator, glossary),
        )
    finally:
        sys.stdout.flush()
    print(report.describe(), file=sys.stderr)
    return 0


def _document_options(args, translator, glossary) -> dict:
    """What --document and --input-format html/xml pass alike to the translator's stream."""
    return {
        "language": args.document_language,
        "origin": args.input or "stdin",
        "progress": flags.given(args, "loop").get("progress"),  # None: when stderr is a terminal
        "max_tokens": args.max_tokens,  # None: TRANSLATE_BATCH_SIZE sentences a batch
        "decode": translator.decode,
        "glossary": glossary,
    }
