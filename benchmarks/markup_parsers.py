#!/usr/bin/env python3
"""HTML parsers compared for translation with markup kept: Python's `html.parser`, `lxml.html` (libxml2),
`html5lib` (the HTML5 spec's tree construction, pure Python) and `selectolax` (lexbor), on documents from
benchmarks/markup_corpus.py (a well-formed set and a --malformed one, made from the same sentences).

    python benchmarks/markup_parsers.py                                   # 200 documents a set, 5 repeats
    python benchmarks/markup_parsers.py --documents 50 --repeats 3 --json parsers.json

Speed: MB of input per second (the documents' UTF-8 bytes; each parser gets bytes and decodes them itself,
html.parser after `bytes.decode("utf-8", "surrogateescape")`), best and median of --repeats, the parsers taking
turns in each repeat. "parse" builds the tree (html.parser: feeds a handler that records every event with
`getpos()`); "parse+walk" also visits every element and reads its name and attributes, as an application would
(html.parser: the same run). Memory: the growth of the peak resident set (VmHWM) of a child process, which reads
only the documents' bytes, while it keeps the results of every document of the set alive, per MB of input
(tracemalloc would not see libxml2's or lexbor's C allocations; lexbor keeps a whole arena per document, so small
documents make its figure large).

Fidelity: (a) source positions: what each parser's API gives, checked for real (html.parser: every event's raw
source slice, from its `getpos()` offset to the next event's, is what the event says, e.g. a start tag's slice is
its `get_starttag_text()`; lxml: `sourceline` against the line of the same tag in the source; html5lib and
lexbor: probed); (b) the sequence of elements (name and attributes, in document order) against html5lib's, whose
tree construction is the spec's: documents identical, and the tags one has more or fewer (tbody: implied by the
spec; a, b, i, em, strong: formatting elements the spec reopens after a misnesting or an unclosed block); the
documents' text (entities decoded, whitespace runs as one space, invalid bytes left out) against html5lib's;
(c) entities: is the raw `&amp;`/`&nbsp;`/`&#8211;` of the source available anywhere, and does the parser's own
serialization give back the input byte for byte. Also: small inputs where tokenizers are known to part ways
(EDGE_CASES), and what each parser makes of invalid UTF-8.
Run it alone on the machine: the figures are wall time.
"""

from __future__ import annotations

import argparse
import difflib
import html as html_lib
import importlib.metadata
import json
import pickle
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/markup_parsers.py` puts benchmarks/ first on the path
    sys.path.insert(0, str(REPO))

from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.markup_corpus import DATA, corpus, load_pool  # noqa: E402

PARSERS = ("html.parser", "lxml.html", "html5lib", "selectolax (lexbor)")
REFERENCE = "html5lib"
SETS = ("well-formed", "malformed")
# Small inputs where tokenizers are known to part ways; the corpus has none of them.
EDGE_CASES = (
    b"<title>a <b>x</b> &amp; y</title>",  # RCDATA: the spec sees no tag inside title or textarea
    b"<textarea>a <b>x</b></textarea>",
    b"<p>a <!-- x -- > y --> z</p>",  # a comment ends at --> only
    b"<p>a <!-- x --!> y</p>",  # --!> ends a comment (a parse error)
    b"<p>a</p></p>",  # a stray </p> makes an empty p
    b"<p>a<3 b</p>",
    b"<script>if (a</b) x()</script>",
    b"<p>a <b>b <p>c</b> d</p>",  # a formatting element across a block: the adoption agency
    b"<p>a &notin; &noti b &#x110000; c</p>",  # entity without semicolon, a code point out of range
)
ENTITY_PROBE = b'<p title="a &amp; b">x &amp; y&nbsp;z &#8211; w &bogus; v</p>'


# --- the parsers ----------------------------------------------------------------------------------------------


class Events(HTMLParser):
    """Records every event of html.parser with its source position (line from 1, column from 0, in characters).
    An event's raw source is the slice from its position to the next event's (`stdlib_raw`)."""

    def __init__(self):
        super().__init__(convert_charrefs=False)  # entities come as their own events: the raw text stays known
        self.events: list[tuple] = []

    def handle_starttag(self, tag, attrs):
        self.events.append(("start", tag, attrs, self.getpos(), self.get_starttag_text()))

    def handle_startendtag(self, tag, attrs):
        self.events.append(("start", tag, attrs, self.getpos(), self.get_starttag_text()))

    def handle_endtag(self, tag):
        self.events.append(("end", tag, None, self.getpos(), None))

    def handle_data(self, data):
        self.events.append(("data", data, None, self.getpos(), data))

    def handle_entityref(self, name):
        self.events.append(("entity", name, None, self.getpos(), None))

    def handle_charref(self, name):
        self.events.append(("charref", name, None, self.getpos(), None))

    def handle_comment(self, data):
        self.events.append(("comment", data, None, self.getpos(), data))

    def handle_decl(self, decl):
        self.events.append(("decl", decl, None, self.getpos(), decl))

    def handle_pi(self, data):
        self.events.append(("pi", data, None, self.getpos(), data))

    def unknown_decl(self, data):
        self.events.append(("decl", data, None, self.getpos(), data))


def stdlib_parse(data: bytes) -> list[tuple]:
    parser = Events()
    parser.feed(data.decode("utf-8", "surrogateescape"))  # invalid bytes survive as lone surrogates
    parser.close()
    return parser.events


def stdlib_raw(data: bytes) -> list[tuple[tuple, str]]:
    """[(event, its raw source text)]: the source from the event's getpos() offset to the next event's."""
    text = data.decode("utf-8", "surrogateescape")
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
    events = stdlib_parse(data)
    offsets = [starts[line - 1] + column for _, _, _, (line, column), _ in events] + [len(text)]
    return [(event, text[offsets[k] : offsets[k + 1]]) for k, event in enumerate(events)]


def stdlib_elements(events: list[tuple]) -> list[tuple]:
    return [(e[1], _attrs(e[2])) for e in events if e[0] == "start"]


def lxml_parse(data: bytes):
    import lxml.html

    return lxml.html.document_fromstring(data, parser=lxml.html.HTMLParser(encoding="utf-8"))


def lxml_elements(tree) -> list[tuple]:
    return [(e.tag, _attrs(e.attrib.items())) for e in tree.iter() if isinstance(e.tag, str)]


def html5lib_parse(data: bytes):
    import html5lib

    return html5lib.parse(data, treebuilder="etree", namespaceHTMLElements=False, transport_encoding="utf-8")


def html5lib_elements(tree) -> list[tuple]:
    return [(e.tag, _attrs(e.attrib.items())) for e in tree.iter() if isinstance(e.tag, str)]


def lexbor_parse(data: bytes):
    from selectolax.lexbor import LexborHTMLParser

    return LexborHTMLParser(data)


def lexbor_elements(tree) -> list[tuple]:
    return [(n.tag, _attrs(n.attributes.items())) for n in tree.root.traverse() if n.is_element_node]


def _attrs(items) -> tuple:
    return tuple(sorted((key, value or "") for key, value in items))


def parsers() -> dict[str, tuple[Callable, Callable]]:
    """{name: (parse(bytes) -> result, elements(result) -> [(tag, attributes)])}."""
    return {
        "html.parser": (stdlib_parse, stdlib_elements),
        "lxml.html": (lxml_parse, lxml_elements),
        "html5lib": (html5lib_parse, html5lib_elements),
        "selectolax (lexbor)": (lexbor_parse, lexbor_elements),
    }


def versions() -> dict[str, str]:
    found = {}
    for package in ("lxml", "html5lib", "selectolax"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    try:
        import lxml.etree

        found["libxml2"] = ".".join(map(str, lxml.etree.LIBXML_VERSION))
    except ImportError:
        pass
    return found


# --- speed and memory ------------------------------------------------------------------------------------------


def speed(sets: dict[str, list[bytes]], repeats: int) -> dict:
    """{set: {parser: {"parse": [MB/s...], "parse+walk": [MB/s...]}}}, the parsers taking turns in each repeat."""
    found = parsers()
    rates = {name: {parser: {"parse": [], "parse+walk": []} for parser in found} for name in sets}
    for name, documents in sets.items():
        megabytes = sum(map(len, documents)) / 1e6
        for parse, _ in found.values():  # warm up: imports, first-call caches
            parse(documents[0])
        for repeat in range(repeats):
            order = list(found)[repeat % len(found) :] + list(found)[: repeat % len(found)]
            for parser in order:
                parse, elements = found[parser]
                start = time.perf_counter()
                for data in documents:
                    parse(data)
                middle = time.perf_counter()
                for data in documents:
                    elements(parse(data))
                end = time.perf_counter()
                rates[name][parser]["parse"].append(megabytes / (middle - start))
                walk = end - middle if parser != "html.parser" else middle - start  # its events are its walk
                rates[name][parser]["parse+walk"].append(megabytes / walk)
    return rates


def peak_kib() -> int:
    """This process's peak resident set in KiB: VmHWM, which starts afresh at exec (ru_maxrss, where there is no
    /proc, keeps the parent's peak across exec, so a child of a big parent reads the parent's)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS


def child_memory(parser: str, path: Path) -> dict:
    """In this (child) process: the peak RSS growth while the results of every document in `path` are kept."""
    docs = pickle.loads(path.read_bytes())
    parse, _ = parsers()[parser]
    parse(docs[0])  # imports and first-call caches before the baseline
    before = peak_kib()
    kept = [parse(d) for d in docs]
    after = peak_kib()
    return {"kept": len(kept), "before_kib": before, "after_kib": after, "input_mb": sum(map(len, docs)) / 1e6}


def memory(documents: list[bytes]) -> dict[str, float | None]:
    """{parser: MiB of peak RSS growth per MB of input}, each parser in its own child process that reads only the
    documents' bytes (a child that made the corpus itself would have its peak from that)."""
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "documents.pickle"
        path.write_bytes(pickle.dumps(documents))
        for parser in PARSERS:
            cmd = [sys.executable, __file__, "--child", parser, "--child-documents", str(path)]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            if done.returncode != 0:
                print(f"memory of {parser}: the child failed: {done.stderr.strip()[-300:]}", file=sys.stderr)
                out[parser] = None
                continue
            figures = json.loads(done.stdout)
            out[parser] = (figures["after_kib"] - figures["before_kib"]) / 1024 / figures["input_mb"]
    return out


# --- fidelity --------------------------------------------------------------------------------------------------


def stdlib_positions(documents: list[bytes]) -> tuple[int, int]:
    """(events whose raw source slice is what the event says, events): a start tag's slice is its
    get_starttag_text(), data's its text, an entity's `&name;` (or `&name`), an end tag's `</name...>`, a comment's
    `<!--` + its text + an end; and the slices start at 0, so together they are the document."""
    right = total = 0
    for data in documents:
        pairs = stdlib_raw(data)
        right -= bool(pairs) and pairs[0][0][3] != (1, 0)  # a document whose first event is not at its start
        for (kind, name, _, _, said), raw in pairs:
            total += 1
            if kind in ("start", "data"):
                right += raw == said
            elif kind in ("entity", "charref"):
                mark = "&" if kind == "entity" else "&#"
                right += raw in (f"{mark}{name};", f"{mark}{name}")
            elif kind == "end":
                right += raw.lower().startswith(f"</{name}") and raw.endswith(">")
            elif kind == "comment":
                right += raw.startswith(f"<!--{said}") and raw.endswith(">")
            else:
                right += raw.startswith("<") and said in raw
    return right, total


def lxml_lines(documents: list[bytes]) -> tuple[int, int]:
    """(elements whose `sourceline` is the line of the same start tag in html.parser's events, elements matched)."""
    right = total = 0
    for data in documents:
        events = [e for e in stdlib_parse(data) if e[0] == "start"]
        tree = lxml_parse(data)
        elements = [e for e in tree.iter() if isinstance(e.tag, str)]
        ours = [(e[1], _attrs(e[2])) for e in events]
        theirs = [(e.tag, _attrs(e.attrib.items())) for e in elements]
        matcher = difflib.SequenceMatcher(None, ours, theirs, autojunk=False)
        for block in matcher.get_matching_blocks():
            for k in range(block.size):
                total += 1
                right += events[block.a + k][3][0] == elements[block.b + k].sourceline
    return right, total


def probe_positions() -> dict[str, str]:
    """What each tree parser's API offers for source positions, tried rather than assumed."""
    found = {}
    tree = lexbor_parse(b"<p>a &amp; b</p>")
    node = tree.css_first("p").child
    try:
        found["selectolax (lexbor)"] = f"raw_value gives {node.raw_value!r}"
    except Exception as error:  # selectolax raises NotImplementedError on lexbor
        found["selectolax (lexbor)"] = f"none: raw_value raises {type(error).__name__} ({error})"
    try:
        from selectolax.parser import HTMLParser as Modest  # noqa: F401

        found["selectolax (modest)"] = "importable"
    except ImportError as error:
        found["selectolax (modest)"] = f"not available: {str(error).split('. ')[0]}"
    element = html5lib_parse(b"<p>a</p>").find(".//p")
    carried = [a for a in ("sourceline", "sourcepos", "pos") if hasattr(element, a)]
    found["html5lib"] = f"has {carried}" if carried else "none: its tree's elements carry no position"
    element = lxml_parse(b"<p>\n<b>a</b></p>").find(".//b")
    found["lxml.html"] = f"line only: sourceline={element.sourceline}, no column or offset"
    return found


def entities() -> dict[str, dict]:
    """For ENTITY_PROBE: the text and attribute each parser reports, and whether the raw entities are anywhere."""
    out = {}
    pairs = stdlib_raw(ENTITY_PROBE)
    events = [event for event, _ in pairs]
    raw = "".join(raw for event, raw in pairs if event[0] in ("data", "entity", "charref"))
    out["html.parser"] = {
        "text": raw,
        "title": dict(events[0][2])["title"],
        "raw kept": "yes: entityref/charref events with positions; get_starttag_text() for attributes",
    }
    lxml_tree = lxml_parse(ENTITY_PROBE)
    p = lxml_tree.find(".//p")
    import lxml.html

    out["lxml.html"] = {
        "text": p.text,
        "title": p.get("title"),
        "raw kept": f"no: tostring gives {lxml.html.tostring(p, encoding='unicode')!r}",
    }
    p = html5lib_parse(ENTITY_PROBE).find(".//p")
    out["html5lib"] = {"text": p.text, "title": p.get("title"), "raw kept": "no"}
    tree = lexbor_parse(ENTITY_PROBE)
    p = tree.css_first("p")
    out["selectolax (lexbor)"] = {
        "text": p.text(deep=False),
        "title": p.attributes["title"],
        "raw kept": f"no: .html gives {p.html!r}",
    }
    return out


def _plain(text: str) -> str:
    """Text for comparison: whitespace runs as one space; invalid bytes (U+FFFD, or surrogates) left out, as the
    decoders differ in how many replacement characters a bad sequence gives."""
    text = "".join(c for c in text if c != "\ufffd" and not 0xDC80 <= ord(c) <= 0xDCFF)
    return " ".join(text.split())


def _etree_text(element) -> list[str]:
    """The text of an xml.etree tree without its comments (its itertext() gives a comment's text too)."""
    out = [element.text or ""] if isinstance(element.tag, str) else []
    for child in element:
        out += _etree_text(child)
        out.append(child.tail or "")
    return out


def texts(parser: str, data: bytes) -> str:
    """All character data of the document (entities decoded; comments left out), as `_plain` text."""
    if parser == "html.parser":
        kept = ("entity", "charref")  # data stays raw: outside script/style it holds no entity (convert_charrefs off)
        pairs = stdlib_raw(data)
        return _plain(
            "".join(html_lib.unescape(raw) if e[0] in kept else e[4] for e, raw in pairs if e[0] in kept + ("data",))
        )
    if parser == "lxml.html":
        return _plain(lxml_parse(data).text_content())
    if parser == "html5lib":
        return _plain("".join(_etree_text(html5lib_parse(data))))
    return _plain(lexbor_parse(data).root.text())


IMPLIED = {"html", "head", "body", "tbody"}


def edge_cases() -> dict[str, dict[str, str]]:
    """{snippet: {parser: what differs from html5lib ("" where nothing)}}: elements (the implied html, head, body and
    tbody left out) and text."""
    found = parsers()
    out = {}
    for data in EDGE_CASES:
        reference = [e for e in found[REFERENCE][1](found[REFERENCE][0](data)) if e[0] not in IMPLIED]
        reference_text = texts(REFERENCE, data)
        out[data.decode()] = {}
        for parser, (parse, elements) in found.items():
            if parser == REFERENCE:
                continue
            ours = [e for e in elements(parse(data)) if e[0] not in IMPLIED]
            text = texts(parser, data)
            notes = []
            if ours != reference:
                notes.append(f"elements {[e[0] for e in ours]} (html5lib {[e[0] for e in reference]})")
            if text != reference_text:
                notes.append(f"text {text!r} (html5lib {reference_text!r})")
            out[data.decode()][parser] = "; ".join(notes)
    return out


def serialize(parser: str, data: bytes) -> bytes | None:
    """The parser's own serialization of its tree (html.parser: the source slices between event offsets)."""
    if parser == "html.parser":
        return None
    if parser == "lxml.html":
        import lxml.html

        tree = lxml_parse(data)
        return lxml.html.tostring(tree, encoding="utf-8", doctype=tree.getroottree().docinfo.doctype)
    if parser == "html5lib":
        import html5lib

        tree = html5lib_parse(data)
        return html5lib.serialize(tree, tree="etree", omit_optional_tags=False, encoding="utf-8")
    return lexbor_parse(data).html.encode("utf-8")


def compare(sets: dict[str, list[bytes]]) -> dict:
    """Per set and parser: documents whose element sequence equals html5lib's, the tags it has more and fewer
    (by name), and documents whose re-serialization is the input byte for byte."""
    found = parsers()
    out = {}
    for name, documents in sets.items():
        reference = [found[REFERENCE][1](found[REFERENCE][0](d)) for d in documents]
        reference_texts = [texts(REFERENCE, d) for d in documents]
        out[name] = {}
        for parser, (parse, elements) in found.items():
            same, more, fewer, changed = 0, Counter(), Counter(), Counter()
            for data, theirs in zip(documents, reference, strict=True):
                ours = elements(parse(data))
                same += ours == theirs
                matcher = difflib.SequenceMatcher(None, ours, theirs, autojunk=False)
                for op, a0, a1, b0, b1 in matcher.get_opcodes():
                    if op == "equal":
                        continue
                    if op == "replace" and a1 - a0 == b1 - b0:
                        changed.update(
                            f"{x[0]}>{y[0]}" if x[0] != y[0] else x[0]
                            for x, y in zip(ours[a0:a1], theirs[b0:b1], strict=True)
                        )
                        continue
                    more.update(x[0] for x in ours[a0:a1])
                    fewer.update(y[0] for y in theirs[b0:b1])
            identical = sum(serialize(parser, d) == d for d in documents) if parser != "html.parser" else None
            same_text = sum(texts(parser, d) == t for d, t in zip(documents, reference_texts, strict=True))
            out[name][parser] = {
                "same_elements": same,
                "same_text": same_text,
                "documents": len(documents),
                "more": dict(more.most_common()),
                "fewer": dict(fewer.most_common()),
                "attributes_or_name_differ": dict(changed.most_common()),
                "reserialized_identical": identical,
            }
    return out


def invalid_bytes(documents: list[bytes]) -> dict[str, str]:
    """What each parser makes of invalid UTF-8: U+FFFD replacements or the bytes kept (html.parser: surrogates)."""
    out = {}
    bad = [d for d in documents if d.decode("utf-8", "replace").encode("utf-8") != d]
    if not bad:
        return out
    text = {
        "html.parser": lambda d: "".join(e[4] for e in stdlib_parse(d) if e[0] == "data"),
        "lxml.html": lambda d: lxml_parse(d).text_content(),
        "html5lib": lambda d: "".join(html5lib_parse(d).itertext()),
        "selectolax (lexbor)": lambda d: lexbor_parse(d).root.text(),
    }
    for parser, get in text.items():
        replaced = kept = 0
        for data in bad:
            found = get(data)
            replaced += found.count("\ufffd")
            kept += sum(0xDC80 <= ord(c) <= 0xDCFF for c in found)
        out[parser] = f"{replaced} U+FFFD, {kept} bytes kept as surrogates ({len(bad)} documents)"
    return out


# --- report ----------------------------------------------------------------------------------------------------


def _tally(counts: dict, top: int = 5) -> str:
    return ", ".join(f"{k}×{v}" for k, v in list(counts.items())[:top]) or "-"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=200, help="documents in each set (default 200)")
    parser.add_argument("--repeats", type=int, default=5, help="timing repeats (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the corpus (default 0)")
    parser.add_argument("--data", type=Path, default=DATA, help="the shared data folder, for the default sources")
    parser.add_argument("--sentences", type=Path, action="append", help="sentence files (markup_corpus.py's flag)")
    parser.add_argument("--no-memory", action="store_true", help="skip the child processes that measure memory")
    parser.add_argument("--json", type=Path, help="also write every figure as JSON")
    parser.add_argument("--child", choices=PARSERS, help=argparse.SUPPRESS)
    parser.add_argument("--child-documents", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child_memory(args.child, args.child_documents)))
        return

    machine = machine_info()
    found_versions = versions()
    pool, sources = load_pool(args.sentences, args.data)
    sets = {
        "well-formed": [d.data for d in corpus(pool, args.documents, args.seed)],
        "malformed": [d.data for d in corpus(pool, args.documents, args.seed, malformed=True)],
    }
    sizes = {name: sum(map(len, docs)) / 1e6 for name, docs in sets.items()}
    print(
        f"{machine['date']}: {machine['cpu_model']}, {machine['cores']} cores, {machine['memory_gib']} GiB, "
        f"Python {machine['libraries']['python']}, load {machine['load_average']}"
    )
    print(", ".join(f"{k} {v}" for k, v in found_versions.items()))
    print(
        ", ".join(f"{name}: {args.documents} documents, {size:.2f} MB" for name, size in sizes.items())
        + f"; sentences from {', '.join(s['path'] for s in sources)}"
    )

    rates = speed(sets, args.repeats)
    mem = {name: memory(documents) for name, documents in sets.items()} if not args.no_memory else None
    fidelity = compare(sets)
    positions = {
        "html.parser": "{} of {} events match their source slice (getpos() offsets)".format(
            *stdlib_positions(sets["well-formed"])
        ),
        "lxml.html": "sourceline right for {} of {} elements; no column".format(*lxml_lines(sets["well-formed"])),
        **{k: v for k, v in probe_positions().items() if k != "lxml.html"},
    }
    positions["html.parser (malformed)"] = "{} of {} events match their source slice (getpos() offsets)".format(
        *stdlib_positions(sets["malformed"])
    )
    entity = entities()
    edges = edge_cases()
    bad = invalid_bytes(sets["malformed"])

    print()
    print(
        "| parser | set | parse MB/s, best / median | parse+walk MB/s, best / median | RSS MiB per input MB | "
        "elements = html5lib's | more than html5lib | fewer than html5lib | text = html5lib's | re-serialized = input |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in SETS:
        for parser in PARSERS:
            r = rates[name][parser]
            f = fidelity[name][parser]
            m = mem[name][parser] if mem else None
            print(
                f"| {parser} | {name} | {max(r['parse']):.2f} / {statistics.median(r['parse']):.2f} "
                f"| {max(r['parse+walk']):.2f} / {statistics.median(r['parse+walk']):.2f} "
                f"| {'-' if m is None else f'{m:.1f}'} | {f['same_elements']}/{f['documents']} "
                f"| {_tally(f['more'])} | {_tally(f['fewer'])} | {f['same_text']}/{f['documents']} "
                f"| {'by offsets' if f['reserialized_identical'] is None else f['reserialized_identical']} |"
            )
    print()
    print("Source positions:")
    for parser, text in positions.items():
        print(f"- {parser}: {text}")
    print(f"Entities in {ENTITY_PROBE.decode()!r}:")
    for parser, seen in entity.items():
        print(f"- {parser}: text {seen['text']!r}, title {seen['title']!r}; raw kept: {seen['raw kept']}")
    print("Edge cases (not in the corpus), where a parser differs from html5lib:")
    for snippet, by_parser in edges.items():
        differ = "; ".join(f"{parser}: {note}" for parser, note in by_parser.items() if note) or "all agree"
        print(f"- {snippet!r}: {differ}")
    print("Invalid UTF-8 (malformed set):")
    for parser, text in bad.items():
        print(f"- {parser}: {text}")
    differ = {
        f"{name} / {parser}": _tally(fidelity[name][parser]["attributes_or_name_differ"])
        for name in SETS
        for parser in PARSERS
        if fidelity[name][parser]["attributes_or_name_differ"]
    }
    if differ:
        print("Same place, different element or attributes than html5lib:")
        for key, text in differ.items():
            print(f"- {key}: {text}")

    if args.json:
        results = {
            "machine": machine,
            "versions": found_versions,
            "documents": args.documents,
            "seed": args.seed,
            "repeats": args.repeats,
            "sources": sources,
            "megabytes": sizes,
            "speed_mb_per_s": rates,
            "rss_mib_per_input_mb": mem,
            "elements": fidelity,
            "positions": positions,
            "entities": entity,
            "invalid_utf8": bad,
            "edge_cases": edges,
        }
        args.json.write_text(json.dumps(results, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
