#!/usr/bin/env python3
"""`translate --document` on real paragraphs: does each sentence get its own translation, and does the layout survive?

    python benchmarks/document_identity.py            # Multi30k's and Tatoeba's German validation sentences

The sentences with an end mark of each set (benchmarks/splitters.py's `paragraphs`: 3 to 6 consecutive ones, seeded)
are written as one document: the sentences of a paragraph joined by one space, two spaces or a tab, paragraphs by a
blank line (every fifth by CRLF line ends, every seventh indented), no final newline. `documents.translate_document`
translates it (read 64 KiB at a time, as the command line reads a file); the expected output is the same document
with every sentence replaced by `translation.translate` of that sentence on a line of its own, the separators
unchanged. Counted: paragraphs whose translated text is the expected one byte for byte, and whether the whole output
is. The model: the small preset's shape in Marian's conventions with random weights
(benchmarks/ctranslate2_decoding.py), its SentencePiece model learned on the sentences, greedy, at most 32 tokens:
what is compared is the splitting and the joining, which do not depend on the weights. A paragraph the splitter
cuts otherwise than its sentences (Tatoeba has lines holding two sentences, and abbreviations sentencex reads as
such) differs; benchmarks/splitters.py counts those.
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.ctranslate2_decoding import marian_shaped_model  # noqa: E402
from benchmarks.machine import core_count, cpu_model  # noqa: E402
from benchmarks.splitters import paragraphs  # noqa: E402

DATA = REPO.parent / "shared" / "data"
SETS = {"Multi30k val": DATA / "multi30k" / "val.de", "Tatoeba valid": DATA / "anki-deu-eng" / "valid.de"}


def document(groups: list[list[str]], rng: random.Random) -> tuple[list[tuple[str, bool]], str]:
    """The document's pieces, (text, is_sentence) in order, and its text."""
    pieces: list[tuple[str, bool]] = []
    for p, group in enumerate(groups):
        if p:
            pieces.append(("\r\n\r\n" if p % 5 == 0 else "\n\n", False))
        if p % 7 == 0:
            pieces.append(("    ", False))
        for s, sentence in enumerate(group):
            if s:
                pieces.append((rng.choice([" ", "  ", "\t"]), False))
            pieces.append((sentence, True))
    return pieces, "".join(text for text, _ in pieces)


def main() -> int:
    from jax_transformer.decoding import documents, loading
    from jax_transformer.decoding.translation import translate
    from jax_transformer.interop import hub

    missing = [str(p) for p in SETS.values() if not p.exists()]
    if missing:
        print(f"the data is not here ({', '.join(missing)}): this benchmark is skipped")
        return 0
    rng = random.Random(0)
    sets = {name: paragraphs(path, rng)[0] for name, path in SETS.items()}
    every = [s for groups in sets.values() for group in groups for s in group]
    print(f"machine: {cpu_model()}, {core_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        config, params, tokenizer = marian_shaped_model("small", 8000, 128, texts=every)
        hub.export_transformers(params, config, tokenizer, {"imported_from": {"family": "marian"}}, tmp / "hf")
        run = hub.import_model(tmp / "hf", tmp / "run", print_fn=lambda line: None)
        loaded = loading.load(run, "latest")
        decode = loading.decoding(loaded, {"beam_size": 1, "max_length": 33, "forced_eos": False})
        segmenter = documents.Segmenter("de", documents.model_fits(loaded.tokenizer, loaded.config))
        print("| set | paragraphs | sentences | paragraphs byte for byte | whole document byte for byte |")
        print("|---|---:|---:|---:|---|")
        for name, groups in sets.items():
            pieces, text = document(groups, rng)
            path = tmp / f"{name}.txt"
            path.write_bytes(text.encode("utf-8"))
            out: list[str] = []
            report = documents.translate_document(loaded.params, loaded.config, loaded.tokenizer,
                                                  documents.read_blocks(path), out.append, decode,
                                                  segmenter=segmenter, progress=False)  # fmt: skip
            got = "".join(out)
            sentences = [t for t, is_sentence in pieces if is_sentence]
            alone = iter(translate(loaded.params, loaded.config, loaded.tokenizer, sentences, decode, progress=False))
            expected_pieces = [next(alone) if is_sentence else t for t, is_sentence in pieces]
            expected = "".join(expected_pieces)
            # Paragraph by paragraph: the output split at the same blank lines as the document.
            got_paragraphs = got.replace("\r\n\r\n", "\n\n").split("\n\n")
            want_paragraphs = expected.replace("\r\n\r\n", "\n\n").split("\n\n")
            same = sum(a == b for a, b in zip(got_paragraphs, want_paragraphs))
            aligned = len(got_paragraphs) == len(want_paragraphs)
            print(
                f"| {name} | {len(groups)} | {len(sentences)} | {same}/{len(groups)}"
                f"{'' if aligned else ' (paragraph count differs)'} | {'yes' if got == expected else 'no'} |"
            )
            print(f"  {report.describe()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
