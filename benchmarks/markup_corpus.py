#!/usr/bin/env python3
"""HTML (and XLIFF-like XML) documents made from real validation sentences, for benchmarks and evaluations of
translation with markup kept (jax_transformer/decoding/markup.py) and of HTML parsers (benchmarks/markup_parsers.py).

    python benchmarks/markup_corpus.py --out /tmp/markup --documents 200            # doc-0000.html ... + tags.json
    python benchmarks/markup_corpus.py --out /tmp/markup-bad --documents 50 --malformed
    python benchmarks/markup_corpus.py --out /tmp/markup-xml --documents 20 --xml    # corpus.xlf + corpus.xlf.json
    python benchmarks/markup_corpus.py --sentences my.de --out /tmp/m        # other sentences (a .tsv: column 1)

Each document: a doctype, `<html lang="de">`, a head with `<title>` (sometimes a `<style>`), a body with a heading,
paragraphs of 1-3 sentences, a list, a table, inline tags around chosen words (b, i, em, strong, a href, span class,
rarely sub/sup; `<br>` or an en dash between sentences sometimes), entities in text (`&amp;`, `&nbsp;`, `&#8211;`),
translatable attributes (`img alt`, `title`, `input placeholder`), untranslatable parts (`<pre>`, `<script>`,
`<style>`, comments, inline `<code>`, `<span translate="no">`, `<div class="notranslate">`), varied indentation,
attribute quoting and, sometimes, upper-case tag names. Deterministic by --seed.

The JSON sidecar lists, per document: `tags`, each inline tag that wraps exactly one source word (its `block`, the
block's tag, the inline `tag`, the `word`, and `word_index`, the word's place among the block's translatable words:
the block's text outside opaque units, entities decoded, split on whitespace); `blocks` (index, tag, plain text, and
the numbers of the input lines its sentences came from, so a reference translation can be found in the parallel
file); `attributes` (translatable attribute texts); `opaque` (raw source strings that must come out byte for byte).
`--malformed` documents carry damage (unclosed tags, stray `<`, stray end tags, misnested `<b><i>x</b></i>`,
invalid UTF-8 bytes) and list it under `damage`; a damaged inline tag is left out of `tags`.

Never commit the generated files: the sentences are the shared corpora's (benchmarks only).
"""

from __future__ import annotations

import argparse
import html as html_lib
import itertools
import json
import random
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data"
# The default sources, under --data: Multi30k's validation set, and Tatoeba's (the full one if present, else tiny).
DEFAULT_SOURCES = (("multi30k/val.de",), ("anki-deu-eng/valid.de", "anki-deu-eng/tiny/valid.tsv"))

# Inline tags and how often each is chosen (sub/sup rarely, as in real pages).
INLINE_WEIGHTS = {"b": 3, "i": 2, "em": 2, "strong": 2, "a": 2, "span": 2, "sub": 0.3, "sup": 0.3}
SPAN_CLASSES = ("hl", "term", "name", "note")
BR_FORMS = ("<br>", "<br/>", "<br />")
CODE_SNIPPETS = ("git commit -a", "x = a < b && c", "ls -l", "print(1)", "SELECT * FROM t", "<i>kein</i> Tag")
NAMES = ("Tatoeba", "Multi30k", "Firefox", "Berlin", "Python")
# Invalid UTF-8 (a lone 0xFF, a lead byte without its continuation, an encoded surrogate, a cut 3-byte form),
# held in the text as private-use characters until the document is encoded.
BAD_BYTES = {"\ue000": b"\xff", "\ue001": b"\xc3(", "\ue002": b"\xed\xa0\x80", "\ue003": b"\xe2\x82"}
UNQUOTABLE = re.compile(r"^[A-Za-z0-9._:/-]+$")


@dataclass
class Document:
    """A generated document: its text, and what an evaluation needs to check a translation of it."""

    html: str  # invalid bytes (malformed documents only) still as BAD_BYTES' private-use characters
    tags: list[dict] = field(default_factory=list)
    blocks: list[dict] = field(default_factory=list)
    attributes: list[dict] = field(default_factory=list)
    opaque: list[str] = field(default_factory=list)
    damage: list[dict] = field(default_factory=list)

    @property
    def data(self) -> bytes:
        """The document as bytes: UTF-8, with the invalid bytes of a malformed document in place."""
        encoded = self.html.encode("utf-8")
        for char, bad in BAD_BYTES.items():
            encoded = encoded.replace(char.encode("utf-8"), bad)
        return encoded

    def sidecar(self) -> dict:
        return {
            "tags": self.tags,
            "blocks": self.blocks,
            "attributes": self.attributes,
            "opaque": self.opaque,
            "damage": self.damage,
        }


class _Block:
    def __init__(self, index: int, tag: str):
        self.index, self.tag = index, tag
        self.words: list[str] = []  # the translatable words so far (entities decoded)
        self.sentences: list[int] = []


class _Builder:
    """Writes one document; every random choice goes through `rng`, so a seed gives the same document."""

    def __init__(self, sentences: Sequence[str], rng: random.Random, malformed: bool):
        if not sentences:
            raise ValueError("make_document needs at least one sentence")
        self.rng, self.malformed = rng, malformed
        self.pool = itertools.cycle(enumerate(sentences))  # a short list is reused rather than running out
        self.doc = Document(html="")
        self.upper = rng.random() < 0.3  # some documents write some tag names in upper case
        self.unit = rng.choice(("  ", "    ", "\t", " "))
        self.blocks: list[_Block] = []

    # --- small pieces -------------------------------------------------------------------------------------------

    def name(self, tag: str) -> str:
        return tag.upper() if self.upper and self.rng.random() < 0.25 else tag

    def attr(self, key: str, value: str) -> str:
        """` key="value"` in one of the quoting styles (unquoted only where HTML allows it)."""
        style = self.rng.random()
        if style < 0.1 and UNQUOTABLE.match(value):
            return f" {key}={value}"
        if style < 0.3:
            return f" {key}='{html_lib.escape(value, quote=True)}'"
        return f' {key}="{html_lib.escape(value, quote=True)}"'

    def indent(self, depth: int) -> str:
        return "\n" + self.unit * depth

    def sentence(self, block: _Block | None = None) -> str:
        number, text = next(self.pool)
        if block is not None:
            block.sentences.append(number)
        return " ".join(text.split())

    def damage(self, kind: str, block: _Block | None) -> None:
        self.doc.damage.append({"kind": kind, "block": None if block is None else block.index})

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    # --- translatable text --------------------------------------------------------------------------------------

    def inline(self, block: _Block, text: str) -> str:
        """One sentence as HTML: escaped, some words wrapped in inline tags, entities and opaque units added."""
        tokens = text.split(" ")
        words = [i for i, t in enumerate(tokens) if t.isalpha() and len(t) > 1]
        single = set(self.rng.sample(words, min(len(words), self.rng.choice((0, 1, 1, 2)))))
        span = None  # (first, last) of a multi-word tag, which the sidecar does not list
        if len(tokens) > 4 and self.chance(0.2):
            first = self.rng.randrange(len(tokens) - 2)
            last = first + self.rng.randint(1, 2)
            if not single.intersection(range(first, last + 1)):
                span = (first, last)
        nbsp = None  # a no-break space instead of the space before token nbsp
        free = [i for i in range(1, len(tokens)) if not {i - 1, i} & single and (span is None or i <= span[0])]
        if free and self.chance(0.15):
            nbsp = self.rng.choice(free)
        out = []
        for i, token in enumerate(tokens):
            if i:
                out.append("&nbsp;" if i == nbsp else " ")
            if span is not None and i == span[0]:
                tag = self.rng.choice(("em", "b", "span"))
                out.append(f"<{tag}>")
            if token == "und" and i not in single and self.chance(0.5):
                out.append("&amp;")
                block.words.append("&")
            elif i in single:
                out.append(self.wrap(block, token))
            else:
                out.append(html_lib.escape(token, quote=False))
                block.words.append(token)
            if span is not None and i == span[1]:
                out.append(f"</{tag}>")
            if i < len(tokens) - 1 and self.chance(0.04):
                out.append(" " + self.opaque_inline())
        return "".join(out)

    def wrap(self, block: _Block, word: str) -> str:
        tag = self.rng.choices(list(INLINE_WEIGHTS), weights=list(INLINE_WEIGHTS.values()))[0]
        attrs = ""
        if tag == "a":
            attrs = self.attr("href", f"https://example.org/{word.lower()}")
            if self.chance(0.3):
                title = f"Mehr über {word}"
                attrs += self.attr("title", title)
                self.doc.attributes.append({"tag": "a", "attribute": "title", "text": title})
        elif tag == "span":
            attrs = self.attr("class", self.rng.choice(SPAN_CLASSES))
        written = self.name(tag)
        escaped = html_lib.escape(word, quote=False)
        if self.malformed and self.chance(0.25):
            kind = self.rng.choice(("misnested", "unclosed inline"))
            self.damage(kind, block)
            block.words.append(word)
            if kind == "misnested":
                return f"<{written}{attrs}><i>{escaped}</{written}></i>"
            return f"<{written}{attrs}>{escaped}"
        self.doc.tags.append(
            {"block": block.index, "block_tag": block.tag, "tag": tag, "word": word, "word_index": len(block.words)}
        )
        block.words.append(word)
        return f"<{written}{attrs}>{escaped}</{written}>"

    def opaque_inline(self) -> str:
        if self.chance(0.5):
            raw = f"<code>{html_lib.escape(self.rng.choice(CODE_SNIPPETS), quote=False)}</code>"
        else:
            raw = f'<span translate="no">{self.rng.choice(NAMES)}</span>'
        self.doc.opaque.append(raw)
        return raw

    def separator(self, block: _Block, depth: int) -> str:
        """What goes between two sentences of a paragraph."""
        roll = self.rng.random()
        if roll < 0.15:
            return self.rng.choice(BR_FORMS).replace("br", self.name("br")) + self.indent(depth)
        if roll < 0.25:
            block.words.append("\u2013")
            return " &#8211; "
        if roll < 0.4:
            return self.indent(depth)
        if self.malformed and roll < 0.5:
            kind = self.rng.choice(("stray <", "stray end tag", "invalid utf-8"))
            self.damage(kind, block)
            if kind == "stray <":
                stray = self.rng.choice(("<", "<=", "<3"))
                block.words.append(stray)
                return f" {stray} "
            if kind == "stray end tag":
                return " " + self.rng.choice(("</span>", "</div>", "</em>", "</td>", "</ul>")) + " "
            return " " + self.rng.choice(list(BAD_BYTES)) + " "
        return " "

    def block(self, tag: str, depth: int, sentences: int, attrs: str = "", close: bool = True) -> str:
        block = _Block(len(self.blocks), tag)
        self.blocks.append(block)
        parts = []
        for n in range(sentences):
            if n:
                parts.append(self.separator(block, depth + 1))
            parts.append(self.inline(block, self.sentence(block)))
        written = self.name(tag)
        text = "".join(parts)
        self.doc.blocks.append(
            {"index": block.index, "tag": tag, "text": " ".join(block.words), "sentences": block.sentences}
        )
        if self.malformed and close and tag in ("p", "li", "td") and self.chance(0.2):
            self.damage("unclosed block", block)
            return f"<{written}{attrs}>{text}"
        return f"<{written}{attrs}>{text}</{written}>"

    # --- sections -----------------------------------------------------------------------------------------------

    def paragraph(self, depth: int) -> str:
        attrs = ""
        if self.chance(0.1):
            title = self.sentence()
            attrs = self.attr("title", title)
            self.doc.attributes.append({"tag": "p", "attribute": "title", "text": title})
        return self.indent(depth) + self.block("p", depth, self.rng.randint(1, 3), attrs)

    def listing(self, depth: int) -> str:
        tag = self.rng.choice(("ul", "ol"))
        items = "".join(self.indent(depth + 1) + self.block("li", depth + 1, 1) for _ in range(self.rng.randint(2, 4)))
        return f"{self.indent(depth)}<{self.name(tag)}>{items}{self.indent(depth)}</{tag}>"

    def table(self, depth: int) -> str:
        rows = []
        for _ in range(self.rng.randint(2, 3)):
            cells = "".join(self.indent(depth + 3) + self.block("td", depth + 3, 1) for _ in range(2))
            rows.append(f"{self.indent(depth + 2)}<{self.name('tr')}>{cells}{self.indent(depth + 2)}</tr>")
        body = "".join(rows)
        if self.chance(0.5):  # tbody written out, or left for the parser to imply
            body = f"{self.indent(depth + 1)}<tbody>{body}{self.indent(depth + 1)}</tbody>"
        return (
            f"{self.indent(depth)}<{self.name('table')}{self.attr('class', 'data')}>{body}{self.indent(depth)}</table>"
        )

    def image(self, depth: int) -> str:
        alt = self.sentence()
        self.doc.attributes.append({"tag": "img", "attribute": "alt", "text": alt})
        number = self.rng.randrange(1000)
        end = self.rng.choice((">", "/>", " />"))
        attrs = self.attr("src", f"bild{number}.jpg") + self.attr("alt", alt)
        return f"{self.indent(depth)}<{self.name('img')}{attrs}{end}"

    def form(self, depth: int) -> str:
        hint = self.sentence()
        self.doc.attributes.append({"tag": "input", "attribute": "placeholder", "text": hint})
        field_ = f"<input{self.attr('type', 'text')}{self.attr('name', 'q')}{self.attr('placeholder', hint)}>"
        start = f"<form{self.attr('action', '/suche')}>"
        return f"{self.indent(depth)}{start}{self.indent(depth + 1)}{field_}{self.indent(depth)}</form>"

    def preformatted(self, depth: int) -> str:
        raw = f"<pre>  {html_lib.escape(self.sentence(), quote=False)}\n    if (a &lt; b) {{ x = 1; }}\n</pre>"
        self.doc.opaque.append(raw)
        return self.indent(depth) + raw

    def script(self, depth: int) -> str:
        text = self.sentence().replace("\\", "").replace('"', "'")
        raw = f'<script>\nvar s = "<b>" + "{text}";\nif (a < b && b > c) {{ document.title = s; }}\n</script>'
        self.doc.opaque.append(raw)
        return self.indent(depth) + raw

    def comment(self, depth: int) -> str:
        raw = f"<!-- {self.sentence().replace('--', '-')} <b>nicht</b> -->"
        self.doc.opaque.append(raw)
        return self.indent(depth) + raw

    def notranslate(self, depth: int) -> str:
        text = html_lib.escape(self.sentence(), quote=False)
        raw = f"<div{self.attr('class', 'notranslate')}>{text} <b>{self.rng.choice(NAMES)}</b></div>"
        self.doc.opaque.append(raw)
        return self.indent(depth) + raw

    def build(self) -> Document:
        head = [self.indent(1) + '<meta charset="utf-8">']
        title = _Block(len(self.blocks), "title")
        self.blocks.append(title)
        text = self.sentence(title)
        title.words = text.split()
        head.append(f"{self.indent(1)}<{self.name('title')}>{html_lib.escape(text, quote=False)}</title>")
        self.doc.blocks.append({"index": 0, "tag": "title", "text": text, "sentences": title.sentences})
        if self.chance(0.5):
            raw = "<style>\np { margin: 0 }\nb::after { content: '&amp;<'; }\n</style>"
            self.doc.opaque.append(raw)
            head.append(self.indent(1) + raw)
        sections = [self.paragraph] * self.rng.randint(3, 6) + [self.listing, self.table, self.image, self.form]
        sections += [self.preformatted, self.script, self.comment, self.notranslate]
        self.rng.shuffle(sections)
        body = [self.indent(1) + self.block("h1", 1, 1, close=False)]
        body += [make(1) + ("\n" if self.chance(0.2) else "") for make in sections]
        doctype = self.rng.choice(("<!DOCTYPE html>", "<!doctype html>"))
        self.doc.html = (
            f'{doctype}\n<{self.name("html")} lang="de">\n<head>{"".join(head)}\n</head>\n'
            f"<{self.name('body')}>{''.join(body)}\n</body>\n</html>\n"
        )
        return self.doc


def build_document(sentences: Sequence[str], rng: random.Random, malformed: bool = False) -> Document:
    """One document made of `sentences` (used in order, from the first, and reused if too few)."""
    return _Builder(sentences, rng, malformed).build()


def make_document(sentences: Sequence[str], rng: random.Random) -> tuple[str, list[dict]]:
    """A well-formed HTML document and its one-word inline tags: `(html, tags)` (see the module's docstring)."""
    doc = build_document(sentences, rng)
    return doc.html, doc.tags


def make_malformed(sentences: Sequence[str], rng: random.Random) -> tuple[bytes, list[dict]]:
    """A damaged HTML document as bytes (it may hold invalid UTF-8), and the damage it carries."""
    doc = build_document(sentences, rng, malformed=True)
    return doc.data, doc.damage


def make_xliff(units: Sequence[str], rng: random.Random) -> tuple[str, list[dict]]:
    """An XLIFF-1.2-like file, one `<trans-unit>` a sentence, with `<g id>` around chosen words and `<x id/>`
    placeholders; and the `<g>` elements that wrap exactly one word (unit id, g id, word, word_index)."""
    lines = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        '<xliff version="1.2" xmlns="urn:oasis:names:tc:xliff:document:1.2">',
        ' <file source-language="de" target-language="en" datatype="html" original="markup_corpus">',
        "  <body>",
    ]
    tags = []
    for unit, text in enumerate(units, start=1):
        tokens = text.split()
        words = [i for i, t in enumerate(tokens) if t.isalpha() and len(t) > 1]
        chosen = set(rng.sample(words, min(len(words), rng.choice((0, 1, 1, 2)))))
        out, inline = [], 0
        for i, token in enumerate(tokens):
            if i:
                out.append(" ")
            escaped = html_lib.escape(token, quote=False)
            if i in chosen:
                inline += 1
                tags.append({"unit": str(unit), "tag": "g", "id": str(inline), "word": token, "word_index": i})
                out.append(f'<g id="{inline}">{escaped}</g>')
            else:
                out.append(escaped)
            if i < len(tokens) - 1 and rng.random() < 0.05:
                inline += 1
                out.append(f'<x id="{inline}"/>')
        lines.append(f'   <trans-unit id="{unit}">')
        lines.append(f"    <source>{''.join(out)}</source>")
        lines.append("   </trans-unit>")
    lines += ["  </body>", " </file>", "</xliff>", ""]
    return "\n".join(lines), tags


def read_sentences(path: Path) -> list[str]:
    """The non-empty lines of a text file, or the first column of a .tsv (German<TAB>English)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise SystemExit(f"{path}: cannot read the sentences ({error.strerror})") from None
    if path.suffix == ".tsv":
        lines = [line.split("\t", 1)[0] for line in lines]
    sentences = [" ".join(line.split()) for line in lines if line.strip()]
    if not sentences:
        raise SystemExit(f"{path}: no sentences (one a line; a .tsv: German in the first column)")
    return sentences


def default_sources(data: Path) -> list[Path]:
    """The first existing file of each of DEFAULT_SOURCES under `data`."""
    found = []
    for choices in DEFAULT_SOURCES:
        for relative in choices:
            if (data / relative).is_file():
                found.append(data / relative)
                break
    if not found:
        raise SystemExit(f"{data}: none of {[c for cs in DEFAULT_SOURCES for c in cs]} found (pass --sentences)")
    return found


def load_pool(sentences: list[Path] | None, data: Path) -> tuple[list[str], list[dict]]:
    """All sentences of the sources in order, and where each source's lines start in that list."""
    pool, sources = [], []
    for path in sentences or default_sources(data):
        lines = read_sentences(path)
        sources.append({"path": str(path), "first": len(pool), "count": len(lines)})
        pool += lines
    return pool, sources


def corpus(pool: Sequence[str], documents: int, seed: int, malformed: bool = False) -> list[Document]:
    """`documents` documents; each takes a seeded run of 25 consecutive sentences from a seeded place in `pool`."""
    rng = random.Random(seed)
    out = []
    for _ in range(documents):
        start = rng.randrange(len(pool))
        chunk = [pool[(start + k) % len(pool)] for k in range(25)]
        doc = build_document(chunk, rng, malformed)
        for block in doc.blocks:  # numbers into the pool, not into the chunk
            block["sentences"] = [(start + k) % len(pool) for k in block["sentences"]]
        out.append(doc)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write into (made if missing)")
    parser.add_argument("--documents", type=int, default=200, help="how many documents (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="the seed of every choice (default 0)")
    parser.add_argument("--data", type=Path, default=DATA, help="the shared data folder, for the default sources")
    parser.add_argument(
        "--sentences", type=Path, action="append", help="a sentence file (repeatable; default: Multi30k val, Tatoeba)"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--malformed", action="store_true", help="damaged documents (malformed-NNNN.html, malformed.json)"
    )
    mode.add_argument("--xml", action="store_true", help="one XLIFF-like file (corpus.xlf) instead of HTML")
    args = parser.parse_args(argv)
    if args.documents < 1:
        parser.error("--documents must be at least 1")
    pool, sources = load_pool(args.sentences, args.data)
    args.out.mkdir(parents=True, exist_ok=True)
    header = {"seed": args.seed, "sources": sources}
    if args.xml:
        rng = random.Random(args.seed)
        start = rng.randrange(len(pool))
        units = [pool[(start + k) % len(pool)] for k in range(args.documents)]
        text, tags = make_xliff(units, rng)
        (args.out / "corpus.xlf").write_text(text, encoding="utf-8")
        sidecar = {**header, "first_sentence": start, "tags": tags}
        (args.out / "corpus.xlf.json").write_text(json.dumps(sidecar, ensure_ascii=False, indent=1) + "\n")
        print(f"wrote {args.out / 'corpus.xlf'}: {len(units)} units, {len(tags)} one-word <g> tags")
        return
    stem = "malformed" if args.malformed else "doc"
    entries, size = [], 0
    for number, doc in enumerate(corpus(pool, args.documents, args.seed, args.malformed)):
        name = f"{stem}-{number:04d}.html"
        data = doc.data
        (args.out / name).write_bytes(data)
        size += len(data)
        entries.append({"file": name, **doc.sidecar()})
    sidecar_path = args.out / ("malformed.json" if args.malformed else "tags.json")
    sidecar_path.write_text(json.dumps({**header, "documents": entries}, ensure_ascii=False, indent=1) + "\n")
    tags = sum(len(e["tags"]) for e in entries)
    print(f"wrote {len(entries)} documents ({size / 1e6:.2f} MB) and {sidecar_path} ({tags} one-word tags)")


if __name__ == "__main__":
    main(sys.argv[1:])
