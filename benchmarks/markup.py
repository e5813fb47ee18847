#!/usr/bin/env python3
"""Markup kept, measured on HTML made from real validation sentences (benchmarks/markup_corpus.py): every
property `translate --input-format html` claims, checked document by document by code of its own (html.parser's
events and lxml's tree, not jax_transformer's), and its speed and peak memory against `translate --document` on the
same text (docs/decoding.md#markup has the tables).

    python benchmarks/markup.py --checkpoint runs/m30k --documents 40 --json markup.json
    python benchmarks/markup.py --checkpoint runs/m30k --documents 40 --malformed      # damaged documents
    python benchmarks/markup.py --checkpoint runs/m30k --speed --memory                # against --document

Checks, per document:
- tags: the output parses, and its sequence of start and end tags (lxml's tree walk: names, attribute names, the
  values of attributes that are not translated) equals the input's;
- bytes: outside the translated text the output is the input's (tags as written, untouched and opaque elements,
  the whitespace around each block's text, comments, the doctype);
- blocks: each block's text, tags removed, equals `translate --document` of the input block's text, byte for byte
  (blocks with an opaque element or a repair left out: their text is not a document's);
- placement: a tag around one word whose translation is unambiguous (the word aligned to exactly one target word
  that is aligned to no other, a content word of 3 letters or more that occurs once in the translation and occurs
  in the human reference) wraps exactly that word's translation. `--show N` prints N of them to check by hand.
"""

from __future__ import annotations

import argparse
import html
import html.parser
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.markup_corpus import DATA, corpus, load_pool  # noqa: E402
from benchmarks.steered_decoding import STOPWORDS  # noqa: E402

# What is a block and what is inline: the HTML rules the feature documents (docs/decoding.md#markup).
INLINE = set("a abbr acronym b bdi bdo big cite data del dfn em font i ins label mark q s small span strike strong sub "
             "sup time tt u br img wbr".split())  # fmt: skip
VOID = set("area base br col embed hr img input keygen link meta param source track wbr".split())
OPAQUE = set("code kbd samp var".split())
UNTOUCHED = set("pre script style textarea svg math".split())
TRANSLATED = {"alt", "title", "placeholder", "lang"}
PUNCT = ".,;:!?\"'()[]«»„“”–-"


# =============================================================================================================
# Reading a document's structure, independently of jax_transformer
# =============================================================================================================


class _Runs(html.parser.HTMLParser):
    """A document as runs: `("tag", raw, name, attrs)` for tags, comments and declarations outside a block's text,
    `("keep", raw)` for untouched content, and `("block", parts)` for a block's inline content, parts being
    ("text", raw, decoded) / ("inline", raw, name, attrs) / ("opaque", raw)."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.text, self.runs, self.block, self.lines = text, [], None, [0]
        self.lines += [m.end() for m in re.finditer("\n", text)]
        self.events = []
        self.feed(text)
        self.close()
        ends = [e[0] for e in self.events[1:]] + [len(text)]
        self.until = None  # (name, depth) inside an untouched or opaque element
        for (start, kind, name, attrs, data), end in zip(self.events, ends):
            self.take(kind, name, attrs, data, text[start:end])
        self.end_block()

    def _at(self) -> int:
        line, column = self.getpos()
        return self.lines[line - 1] + column

    def handle_starttag(self, tag, attrs):
        self.events.append((self._at(), "start", tag, attrs, None))

    def handle_startendtag(self, tag, attrs):
        self.events.append((self._at(), "startend", tag, attrs, None))

    def handle_endtag(self, tag):
        self.events.append((self._at(), "end", tag, [], None))

    def handle_data(self, data):
        self.events.append((self._at(), "data", "", [], data))

    def handle_comment(self, data):
        self.events.append((self._at(), "other", "", [], None))

    handle_decl = handle_pi = unknown_decl = handle_comment

    def end_block(self) -> None:
        if self.block:
            self.runs.append(("block", self.block))
        self.block = None

    def take(self, kind, name, attrs, data, raw) -> None:
        if self.until is not None:
            until, depth, parts, opaque = self.until
            parts.append(raw)
            depth += (kind == "start" and name == until) - (kind == "end" and name == until)
            if depth:
                self.until = (until, depth, parts, opaque)
                return
            self.until = None
            if opaque:
                self.block = (self.block or []) + [("opaque", "".join(parts))]
            else:
                self.runs.append(("keep", "".join(parts)))
            return
        attributes = dict(attrs)
        opaque = kind == "start" and (
            name in OPAQUE or attributes.get("translate") == "no" or "notranslate" in (attributes.get("class") or "")
        )
        if kind == "data":
            self.block = (self.block or []) + [("text", raw, data)]
        elif kind == "start" and (name in UNTOUCHED or (opaque and name not in INLINE and name not in OPAQUE)):
            self.end_block()
            self.until = (name, 1, [raw], False)
        elif opaque:
            self.until = (name, 1, [raw], True)
        elif kind in ("start", "startend", "end") and name in INLINE:
            self.block = (self.block or []) + [("inline", raw, kind, name, attrs)]
        else:
            self.end_block()
            self.runs.append(("tag", raw, kind, name, attrs))


def block_text(parts) -> str:
    """A block's text as the model reads it: tags removed, entities decoded, line breaks as spaces."""
    return re.sub(r"[\n\r\v\f\x85\u2028\u2029]", " ", "".join(p[2] for p in parts if p[0] == "text"))


def lxml_tags(text: str) -> list[tuple]:
    """The start and end tags of lxml's tree (libxml2's repair), with attribute names and untranslated values."""
    import lxml.etree
    import lxml.html

    root = lxml.html.document_fromstring(text.encode("utf-8", "surrogateescape"))
    out = []
    for action, element in lxml.etree.iterwalk(root, events=("start", "end")):
        if not isinstance(element.tag, str):
            continue
        attrs = tuple((k, None if k in TRANSLATED else v) for k, v in element.attrib.items())
        out.append((action, element.tag, attrs) if action == "start" else (action, element.tag))
    return out


# =============================================================================================================
# The checks
# =============================================================================================================


def compare(source: str, translated: str, expected_blocks: dict[int, str] | None) -> dict:
    """Tags, bytes and block texts of one document (`expected_blocks`: block number -> its --document text)."""
    out = {"tags_equal": lxml_tags(source) == lxml_tags(translated), "bytes_equal": True, "blocks": 0,
           "blocks_equal": 0, "faults": []}  # fmt: skip
    a, b = _Runs(source).runs, _Runs(translated).runs
    if [r[0] for r in a] != [r[0] for r in b]:
        out["bytes_equal"] = False
        out["faults"].append("the runs of tags and blocks differ")
        return out
    number = -1
    for ra, rb in zip(a, b):
        if ra[0] == "keep" and ra[1] != rb[1]:
            out["bytes_equal"] = False
            out["faults"].append(f"untouched content differs: {ra[1][:60]!r}")
        if ra[0] == "tag" and ra[1] != rb[1]:
            same = ra[2:4] == rb[2:4] and [(k, v) for k, v in ra[4] if k not in TRANSLATED] == [
                (k, v) for k, v in rb[4] if k not in TRANSLATED
            ]
            if not same:
                out["bytes_equal"] = False
                out["faults"].append(f"a tag differs: {ra[1][:60]!r} -> {rb[1][:60]!r}")
        if ra[0] != "block":
            continue
        number += 1
        sa, sb = "".join(p[1] for p in ra[1]), "".join(p[1] for p in rb[1])
        lead = lambda s: s[: len(s) - len(s.lstrip())]  # noqa: E731
        trail = lambda s: s[len(s.rstrip()) :]  # noqa: E731
        if not block_text(ra[1]).strip():  # whitespace and void tags between blocks (an img's alt translated)
            if _masked(ra[1]) != _masked(rb[1]):
                out["bytes_equal"] = False
                out["faults"].append(f"whitespace between blocks differs: {sa!r} -> {sb!r}")
            continue
        if not (sb.startswith(lead(sa)) and sb.endswith(trail(sa))):  # (a translation may end in a space itself)
            out["bytes_equal"] = False
            out["faults"].append(f"the whitespace around a block differs: {sa[:40]!r} -> {sb[:40]!r}")
        opaque_a = [p[1] for p in ra[1] if p[0] == "opaque"]
        if sorted(opaque_a) != sorted(p[1] for p in rb[1] if p[0] == "opaque"):
            out["bytes_equal"] = False
            out["faults"].append(f"an opaque element differs: {opaque_a}")
        if expected_blocks is not None and number in expected_blocks:
            out["blocks"] += 1
            got = block_text(rb[1])
            if got == expected_blocks[number]:
                out["blocks_equal"] += 1
            else:
                out["faults"].append(f"block {number}: {got!r} != --document's {expected_blocks[number]!r}")
    return out


def _masked(parts) -> list:
    """A block's parts with tags as name and untranslated attributes."""
    kept = lambda attrs: [(k, v) for k, v in attrs if k not in TRANSLATED]  # noqa: E731
    return [p[:2] if p[0] != "inline" else (p[2], p[3], kept(p[4])) for p in parts]


def plain_blocks(source: str) -> dict[int, str]:
    """Block number -> text, for the blocks with text, no opaque element and no damage."""
    out, number = {}, -1
    for run in _Runs(source).runs:
        if run[0] != "block":
            continue
        number += 1
        text = block_text(run[1])
        if text.strip() and not any(p[0] == "opaque" for p in run[1]) and "\ufffd" not in text and "<" not in text:
            out[number] = text
    return out


def strip(word: str) -> str:
    return word.strip(PUNCT)


def placement(translator, source: str, translated: str, references: dict[str, str], show: list) -> tuple[int, int]:
    """(placed exactly, checked): one-word inline tags whose translation is unambiguous (see the docstring)."""
    from jax_transformer.decoding import markup

    aligned = markup.aligned_translator(translator.params, translator.config, translator.tokenizer, translator.decode)
    segmenter = translator.segmenter()
    runs_a = [r for r in _Runs(source).runs if r[0] == "block"]
    runs_b = [r for r in _Runs(translated).runs if r[0] == "block"]
    checked = placed = 0
    for ra, rb in zip(runs_a, runs_b):
        if any(p[0] == "opaque" for p in ra[1]):
            continue
        tags_a = _one_word_tags(ra[1])
        tags_b = _tag_texts(rb[1])
        if not tags_a or len(tags_b) != len(_tag_texts(ra[1])):
            continue
        text = block_text(ra[1])
        pieces, at = [], 0
        for piece in segmenter.split(text):
            if piece.sentence:
                pieces.append((at, piece.text))
            at += len(piece.text)
        for order, (start, word) in tags_a.items():
            sentence = next(((s, t) for s, t in pieces if s <= start < s + len(t)), None)
            if sentence is None or strip(word) == "" or not strip(word).isalpha():
                continue
            s, t = sentence
            index = len(t[: start - s].split())  # the word's place among the sentence's words
            (target, pairs), = aligned([t])  # fmt: skip
            if pairs is None:
                continue
            mine = [j for i, j in pairs if i == index]
            if len(mine) != 1 or [i for i, j in pairs if j == mine[0]] != [index]:
                continue
            expected = strip(target.split()[mine[0]])
            reference = references.get(t)
            if not expected.isalpha() or [strip(w) for w in target.split()].count(expected) != 1:
                continue
            if expected.lower() in STOPWORDS or len(expected) < 3:  # a content word: its translation is checkable
                continue
            if reference is None or expected.lower() not in {strip(w).lower() for w in reference.split()}:
                continue
            checked += 1
            got = strip(tags_b[order].strip())
            placed += got == expected
            show.append({"source": t, "word": word, "translation": target, "expected": expected, "got": got})
    return placed, checked


def _tag_texts(parts) -> list[str]:
    """The text inside each inline element of a block, in the order their start tags come."""
    texts, open_ = [], []
    for p in parts:
        if p[0] == "inline" and p[2] == "start" and p[3] not in VOID:
            texts.append("")
            open_.append(len(texts) - 1)
        elif p[0] == "inline" and p[2] == "end" and open_:
            open_.pop()
        elif p[0] == "text":
            for i in open_:
                texts[i] += p[2]
    return texts


def _one_word_tags(parts) -> dict[int, tuple[int, str]]:
    """Inline elements that wrap one word with nothing else inside: order among the block's elements -> (where the
    word starts in the block's text, the word)."""
    found, order, at = {}, -1, 0
    for n, p in enumerate(parts):
        if p[0] == "inline" and p[2] == "start" and p[3] not in VOID:
            order += 1
            nxt = parts[n + 1 : n + 3]
            if (len(nxt) == 2 and nxt[0][0] == "text" and nxt[1][0] == "inline" and nxt[1][2] == "end"
                    and len(nxt[0][2].split()) == 1 and nxt[0][2].strip() == nxt[0][2]):  # fmt: skip
                found[order] = (at, nxt[0][2])
        elif p[0] == "text":
            at += len(p[2])
    return found


# =============================================================================================================
# Speed and memory against --document
# =============================================================================================================


def sentences_of(page: str, translator) -> str:
    """The text a page's translation translates, as a document: each sentence it sends to the model (blocks,
    opaque content within them, attribute values) on a line of its own."""
    from jax_transformer.decoding import markup

    asked: list[str] = []

    def spy(sentences: list[str]):
        asked.extend(sentences)
        return [(sentence, None) for sentence in sentences]

    markup.translate_markup_text(page, spy, segmenter=translator.segmenter(), target_language="en")
    return "\n".join(asked) + "\n"


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        out.append(time.perf_counter() - began)
    return out


_PEAK = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def peak_rss(command: list[str]) -> tuple[float, float]:
    """(peak resident MiB, seconds) of a command, in a child of its own (so no other child's peak counts)."""
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _PEAK, *command], check=True, capture_output=True, text=True)
    return int(done.stdout.split()[-1]) / 1024, time.perf_counter() - began


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a de->en run (Multi30k's)")
    parser.add_argument("--documents", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--malformed", action="store_true", help="damaged documents: only tags/bytes/no traceback")
    parser.add_argument("--speed", action="store_true", help="time --input-format html against --document")
    parser.add_argument("--memory", action="store_true", help="peak memory of both, in child processes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--show", type=int, default=30, help="placements printed for a check by hand")
    parser.add_argument("--alignment-layer", type=int, help="the decoder layer whose cross-attention aligns")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from jax_transformer import Translator
    from jax_transformer.decoding import markup

    pool, sources = load_pool(None, args.data)
    references: dict[str, str] = {}
    for source in sources:  # the English side of each German file, line by line
        english = Path(source["path"]).with_suffix(".en")
        if english.is_file():
            lines = english.read_text(encoding="utf-8").splitlines()
            lines = [" ".join(line.split()) for line in lines if line.strip()]
            for k, line in enumerate(lines[: source["count"]]):
                references[pool[source["first"] + k]] = line
    docs = corpus(pool, args.documents, args.seed, args.malformed)
    layer = {} if args.alignment_layer is None else {"alignment_layer": args.alignment_layer}
    translator = Translator(args.checkpoint, **layer)
    machine = machine_info()
    print(f"machine: {machine['cpu_model']}, {machine['cores']} cores; {len(docs)} documents", file=sys.stderr)
    results = {"machine": machine, "documents": len(docs), "malformed": args.malformed, "seed": args.seed}
    totals = {"tags_equal": 0, "bytes_equal": 0, "blocks": 0, "blocks_equal": 0, "placed": 0, "checked": 0,
              "repairs": 0, "unplaced": 0, "placed_by_report": 0, "tracebacks": 0}  # fmt: skip
    reasons: dict[str, int] = {}
    show: list = []
    faults = []
    for n, doc in enumerate(docs):
        source = doc.data.decode("utf-8", "surrogateescape")
        report = markup.MarkupReport()
        try:
            translated = translator.translate_markup(source, target_language="en", report=report)
        except Exception as e:  # noqa: BLE001 (counted: the claim is that none happens)
            totals["tracebacks"] += 1
            faults.append(f"document {n}: {type(e).__name__}: {e}")
            continue
        totals["repairs"] += report.repair_count
        totals["unplaced"] += report.unplaced_count
        totals["placed_by_report"] += report.placed
        for note in report.unplaced:  # why, by the report's words
            why = note.what.split(": ", 1)[1].split(";")[0]
            reasons[why] = reasons.get(why, 0) + 1
        expected = None
        if not args.malformed:
            blocks = plain_blocks(source)
            expected = dict(zip(blocks, (translator.translate_document(t) for t in blocks.values())))
        found = compare(source, translated, expected)
        for key in ("tags_equal", "bytes_equal"):
            totals[key] += found[key]
        totals["blocks"] += found["blocks"]
        totals["blocks_equal"] += found["blocks_equal"]
        faults += [f"document {n}: {f}" for f in found["faults"]]
        if not args.malformed:
            placed, checked = placement(translator, source, translated, references, show)
            totals["placed"] += placed
            totals["checked"] += checked
        print(f"document {n + 1}/{len(docs)}: {totals}", file=sys.stderr)
    results.update(totals=totals, unplaced_reasons=reasons, faults=faults[:50], sample=show[: args.show])
    print(json.dumps(totals, indent=1))
    print(json.dumps(reasons, indent=1))
    for fault in faults[:20]:
        print("FAULT", fault)
    for s in random.Random(0).sample(show, min(args.show, len(show))):
        mark = "ok " if s["expected"] == s["got"] else "BAD"
        print(f"{mark} {s['word']!r} -> {s['expected']!r} (got {s['got']!r}) | {s['source']} | {s['translation']}")

    if args.speed or args.memory:
        pages = [doc.data.decode("utf-8", "surrogateescape") for doc in docs]
        texts = [sentences_of(page, translator) for page in pages]
        if args.speed:
            run_html = lambda: [translator.translate_markup(p, target_language="en") for p in pages]  # noqa: E731
            run_doc = lambda: [translator.translate_document(t) for t in texts]  # noqa: E731
            run_html(), run_doc()  # every program compiled
            html_s, doc_s = [], []
            for _ in range(args.repeats):  # alternated: the machine's drift falls on both
                html_s += timed(run_html, 1)
                doc_s += timed(run_doc, 1)
            echo = lambda s: [(x, [(i, i) for i in range(len(x.split()))]) for x in s]  # noqa: E731 (no model)
            segmenter = translator.segmenter()
            run_markup = lambda: [markup.translate_markup_text(p, echo, segmenter=segmenter) for p in pages]  # noqa: E731
            markup_s = timed(run_markup, args.repeats)
            results["speed"] = {
                "html_s": {"min": min(html_s), "median": statistics.median(html_s)},
                "document_s": {"min": min(doc_s), "median": statistics.median(doc_s)},
                "markup_alone_s": {"min": min(markup_s), "median": statistics.median(markup_s)},
                "sentences": sum(text.count("\n") for text in texts),
            }
            print(json.dumps(results["speed"], indent=1))
        if args.memory:
            with tempfile.TemporaryDirectory() as tmp:
                page, text = Path(tmp, "all.html"), Path(tmp, "all.txt")
                page.write_text("\n".join(pages), encoding="utf-8", errors="surrogateescape")
                text.write_text("\n\n".join(texts), encoding="utf-8")
                base = [sys.executable, str(Path(__file__).resolve().parent.parent / "train.py"), "translate",
                        "--checkpoint", args.checkpoint]  # fmt: skip
                rss_html = peak_rss(base + ["--input-format", "html", "--input", str(page)])
                rss_doc = peak_rss(base + ["--document", "--input", str(text)])
            results["memory"] = {"html": rss_html, "document": rss_doc}
            print(json.dumps(results["memory"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
