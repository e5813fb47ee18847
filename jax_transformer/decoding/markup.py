"""Markup kept: HTML and XML translated with every byte outside the translated text as it was, and the inline tags
of a sentence placed on the words that translate the words they wrapped, by word alignments.

- The tokenizer is Python's `html.parser` (CPython's, maintained with the language): the one parser at hand whose
  events carry their place in the source (`getpos`) and a start tag's text as written, so the output is the input's
  bytes outside the translated text, never a re-serialisation (lxml, html5lib and selectolax give a repaired tree
  and no source offsets: docs/decoding.md#markup compares them). XML goes through the same tokenizer, its names
  compared without case, with no element whose content is raw text.
- `Rules`: which elements are inline (placed by alignment), opaque (carried whole, placed by alignment: `code`,
  `kbd`, `translate="no"`, `class="notranslate"`), untouched (`pre`, `script`, `style`, ...: left where they are);
  any other element ends a block. The limits on nesting, attribute size and document size.
- A block's text (tags removed, entities decoded, line breaks read as the spaces HTML renders) is cut into sentences
  and separators as `translate --document` cuts a line (`documents.Segmenter`); each sentence is translated with
  its word alignment; separators are written as they were in the source.
- Placing (`_Placer`, `_Sentence`): an inline element wraps the smallest span of the target words aligned to its
  words; then the tags are made to nest and keep the source's order (a child inside its parent, siblings in turn,
  `_keep_edge_order` at a sentence's edges), so the output's sequence of tags is the input's; what could not be
  placed exactly is reported.
- `translate_markup`: chunks of a document in, its translation written as it goes, in bounded memory, with a
  `MarkupReport` of what was repaired and which tags could not be placed exactly; `Prepared`: a text read first,
  its sentences translated by the caller (the service), then rendered.
- `aligned_translator`: a model's sentences-to-(translation, word pairs) function; `word_pairs`: a hypothesis's
  alignment counted over the whitespace-separated words of both sides.
"""

from __future__ import annotations

import bisect
import codecs
import dataclasses
import html
import html.parser
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from jax_transformer.decoding import alignment, documents, translation
from jax_transformer.errors import DataError, UsageError

# A sentence's translation and its word pairs (source word, target word), both counted over the whitespace-separated
# words of the sentence and of the translation; None where no alignment is at hand (sampling).
Aligned = tuple[str, "list[tuple[int, int]] | None"]
TranslateFn = Callable[[list[str]], list[Aligned]]

MAX_NOTES = 50  # repairs and placements listed in a report at most (all are counted)
BLOCK_CHARS = 1 << 20  # a block's text held at most: a longer one is cut (reported)


# =============================================================================================================
# Rules
# =============================================================================================================

_HTML_INLINE = """a abbr acronym b bdi bdo big cite data del dfn em font i ins label mark q s small span strike strong
sub sup time tt u br img wbr""".split()
_HTML_VOID = "area base br col embed hr img input keygen link meta param source track wbr".split()
_HTML_OPAQUE = "code kbd samp var".split()
_HTML_UNTOUCHED = "pre script style textarea svg math".split()
# Elements whose end tag HTML lets out: a new one closes the one open (for the nesting count only).
_OPTIONAL_END = {"p", "li", "dt", "dd", "tr", "td", "th", "option", "optgroup", "thead", "tbody", "tfoot", "rt", "rp"}


@dataclasses.dataclass(frozen=True)
class Rules:
    """How a document's elements are read. `inline`: placed inside a sentence by alignment (`void` ones have no
    content); `opaque`: carried whole (inline: placed by alignment; else a block left as it is); `untouched`: left
    where they are with their content; any other element ends a block. `attributes`: attribute values translated;
    `lang`: attributes set to the target's code. Limits: elements open at once, an attribute's characters, the
    document's bytes."""

    xml: bool = False
    inline: frozenset = frozenset(_HTML_INLINE)
    void: frozenset = frozenset(_HTML_VOID)
    opaque: frozenset = frozenset(_HTML_OPAQUE)
    untouched: frozenset = frozenset(_HTML_UNTOUCHED)
    attributes: frozenset = frozenset({"alt", "title", "placeholder"})
    lang: frozenset = frozenset({"lang", "xml:lang"})
    max_depth: int = 512
    max_attribute: int = 1 << 16
    max_bytes: int = 1 << 30

    @classmethod
    def of(cls, xml: bool = False, keep_attributes: bool = False, inline=None, opaque=None) -> Rules:
        """The rules of HTML, or of XML (`inline`, `opaque`: default XLIFF's; its attributes always left)."""
        if not xml:
            return cls.html(keep_attributes)
        return cls.xml_rules(**{k: v for k, v in {"inline": inline, "opaque": opaque}.items() if v})

    @classmethod
    def html(cls, keep_attributes: bool = False, **limits) -> Rules:
        return cls(attributes=frozenset() if keep_attributes else cls.attributes, **limits)

    @classmethod
    def xml_rules(cls, inline: Iterable[str] = ("g", "x", "bx", "ex", "ph", "mrk"),
                  opaque: Iterable[str] = ("ph", "bpt", "ept", "it"), **limits) -> Rules:  # fmt: skip
        """XML: XLIFF's inline elements by default; an element with no content (`<x/>`) is void; attributes are
        left as written (XML has no vocabulary that says which hold text), but xml:lang."""
        inline = frozenset(name.lower() for name in inline)
        return cls(xml=True, inline=inline | frozenset(o.lower() for o in opaque), void=frozenset(),
                   opaque=frozenset(o.lower() for o in opaque), untouched=frozenset(), attributes=frozenset(),
                   lang=frozenset({"xml:lang"}), **limits)  # fmt: skip


# =============================================================================================================
# The report
# =============================================================================================================


@dataclasses.dataclass
class Note:
    """A place in the input (line and column, both 1-based) and what was done there."""

    line: int
    column: int
    what: str

    def __str__(self) -> str:
        return f"line {self.line}, column {self.column}: {self.what}"


@dataclasses.dataclass
class MarkupReport:
    """What `translate_markup` did: blocks and sentences translated, attribute values translated, inline tags
    placed exactly and not (`unplaced`: where and why, the first MAX_NOTES), sentences without an alignment (their
    tags wrap the whole sentence), and what the parser repaired (`repairs`)."""

    origin: str = "input"
    kind: str = "html"
    blocks: int = 0
    sentences: int = 0
    attributes: int = 0
    placed: int = 0
    unplaced_count: int = 0
    unaligned: int = 0
    repair_count: int = 0
    unplaced: list[Note] = dataclasses.field(default_factory=list)
    repairs: list[Note] = dataclasses.field(default_factory=list)

    def _add(self, notes: list[Note], place: tuple[int, int], what: str) -> None:
        if len(notes) < MAX_NOTES:
            notes.append(Note(place[0], place[1] + 1, what))

    def repair(self, place: tuple[int, int], what: str) -> None:
        self.repair_count += 1
        self._add(self.repairs, place, what)

    def not_placed(self, place: tuple[int, int], what: str) -> None:
        self.unplaced_count += 1
        self._add(self.unplaced, place, what)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["unplaced"] = [str(n) for n in self.unplaced]
        out["repairs"] = [str(n) for n in self.repairs]
        return out

    def describe(self) -> str:
        text = (
            f"translated {self.sentences} sentences in {self.blocks} blocks of {self.kind} and {self.attributes} "
            f"attribute values; {self.placed} inline tags placed by alignment"
        )
        if self.unplaced_count:
            text += f", {self.unplaced_count} not exactly (at {self.origin}: " + "; ".join(map(str, self.unplaced))
            text += ", ..." * (self.unplaced_count > len(self.unplaced)) + ")"
        if self.unaligned:
            text += f"; {self.unaligned} sentences without an alignment: their tags wrap the whole sentence"
        if self.repair_count:
            text += f"; {self.repair_count} repairs of the markup (at {self.origin}: " + "; ".join(
                map(str, self.repairs)
            )
            text += ", ..." * (self.repair_count > len(self.repairs)) + ")"
        return text


# =============================================================================================================
# Reading: bytes to text, the encoding checked
# =============================================================================================================

_META_CHARSET = re.compile(rb"""<meta[^>]*?charset\s*=\s*["']?\s*([-\w.:]+)""", re.IGNORECASE)
_XML_ENCODING = re.compile(rb"""^(?:\xef\xbb\xbf)?\s*<\?xml[^>]*?encoding\s*=\s*["']([-\w.:]+)""")
_UTF8 = {"utf-8", "utf8"}


def read_markup(
    source: str | os.PathLike | BinaryIO, report: MarkupReport, block: int = documents.BLOCK_BYTES,
    max_bytes: int = 1 << 30,
) -> Iterator[str]:  # fmt: skip
    """The text of a file or binary stream of UTF-8 markup, a block at a time. A byte-order mark of UTF-16 or UTF-32,
    or a `<meta charset>` / XML declaration naming another encoding, is a DataError naming it; bytes that are not
    UTF-8 are kept as they are outside the translated text (U+FFFD inside it) and reported; more than `max_bytes`
    bytes is a DataError naming the limit."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            with open(path, "rb") as f:
                yield from read_markup(f, report, block, max_bytes)
        except OSError as e:
            raise DataError(f"{path}: cannot read: {e.strerror or e}") from e
        return
    origin = report.origin
    decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    offset = newlines = column = 0  # bytes read; lines ended; characters of the last line read
    while raw := source.read(block):
        if offset == 0:
            for bom, name in ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                              (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16")):  # fmt: skip
                if raw.startswith(bom):
                    raise DataError(
                        f"{origin}, line 1: starts with a {name} byte-order mark: give UTF-8 (iconv -t UTF-8)"
                    )
            head = raw[:4096]
            for pattern, what in ((_META_CHARSET, "a <meta charset>"), (_XML_ENCODING, "the XML declaration")):
                found = pattern.search(head)
                named = found.group(1).decode("ascii", "replace") if found else "utf-8"
                if named.lower() not in _UTF8:
                    line = head[: found.start()].count(b"\n") + 1
                    raise DataError(
                        f"{origin}, line {line}: {what} names the encoding {named}: give UTF-8 (iconv -f {named} -t "
                        f"UTF-8)"
                    )
        if offset + len(raw) > max_bytes:
            head = raw[: max_bytes - offset].decode("utf-8", "surrogateescape")
            line, at = newlines + head.count("\n") + 1, _column_after(head, column)
            raise DataError(
                f"{origin}, line {line}, column {at + 1}: longer than the limit of {max_bytes} bytes for markup (the "
                f"limit is reached at byte offset {max_bytes})"
            )
        text = decoder.decode(raw)
        for bad in re.finditer("[\udc80-\udcff]+", text):
            before = text[: bad.start()]
            line = newlines + before.count("\n") + 1
            what = f"{len(bad.group())} bytes not UTF-8 (kept as they are; U+FFFD in translated text)"
            report.repair((line, _column_after(before, column)), what)
        newlines += text.count("\n")
        column = _column_after(text, column)
        offset += len(raw)
        if text:
            yield text
    rest = decoder.decode(b"", final=True)
    if rest:
        report.repair((newlines + 1, column), "the input ends inside a UTF-8 character (its bytes kept)")
        yield rest


def _column_after(text: str, column: int) -> int:
    """The column (0-based) after `text`, read from `column` on."""
    return len(text) - text.rfind("\n") - 1 if "\n" in text else column + len(text)


def write_bytes(text: str) -> bytes:
    """Output text as the input's bytes: bytes that were not UTF-8 come back as they were."""
    return text.encode("utf-8", "surrogateescape")


def OutputBytes(fd: int, name: str = "stdout") -> documents.OutputText:
    """`documents.OutputText` that writes bytes that were not UTF-8 back as they were."""
    return documents.OutputText(fd, name, errors="surrogateescape")


# =============================================================================================================
# Tokens: html.parser's events with their place in the source
# =============================================================================================================


@dataclasses.dataclass
class _Event:
    kind: str  # start, end, startend, data, other
    name: str
    attrs: list
    start: int  # offset of the event's first character in the whole text
    place: tuple[int, int]  # (line, column 0-based)
    data: str = ""
    raw: str = ""  # filled when the next event's start is known


class _Tokenizer(html.parser.HTMLParser):
    """html.parser with each event recorded with its offset: events are contiguous, so an event's text runs to the
    next one's start (`getpos` gives line and column; a table of line starts makes them offsets)."""

    def __init__(self, xml: bool) -> None:
        super().__init__(convert_charrefs=True)
        if xml:
            self.CDATA_CONTENT_ELEMENTS = ()  # XML has no element whose content is raw text
        self.events: list[_Event] = []
        self.fed = 0  # characters fed
        self.lines = [0]  # offset of each line's start, from `first_line`
        self.first_line = 1

    def feed(self, data: str) -> None:
        self.lines.extend(self.fed + m.end() for m in re.finditer("\n", data))
        self.fed += len(data)
        super().feed(data)

    def forget_lines(self) -> None:
        """Drops the line starts before the last event's line (memory stays bounded with the document's lines)."""
        if self.events:
            line = self.events[-1].place[0]
            drop = line - self.first_line
            if drop > 4096:
                del self.lines[:drop]
                self.first_line = line

    def _add(self, kind: str, name: str = "", attrs=(), data: str = "") -> None:
        line, column = self.getpos()
        start = self.lines[line - self.first_line] + column
        self.events.append(_Event(kind, name, list(attrs), start, (line, column), data))

    def parse_endtag(self, i):
        seen = len(self.events)
        k = super().parse_endtag(i)
        if k > i and len(self.events) == seen:  # "</>", which the parser drops without an event: kept as written
            self._add("other", "!skipped")
        return k

    def handle_starttag(self, tag, attrs):
        self._add("start", tag, attrs)

    def handle_startendtag(self, tag, attrs):
        self._add("startend", tag, attrs)

    def handle_endtag(self, tag):
        self._add("end", tag)

    def handle_data(self, data):
        self._add("data", data=data)

    def handle_comment(self, data):
        self._add("other", "!comment")

    def handle_decl(self, decl):
        self._add("other", "!decl")

    def handle_pi(self, data):
        self._add("other", "?pi")

    def unknown_decl(self, data):
        self._add("other", "!decl")


def _place_in(event: _Event, k: int) -> tuple[int, int]:
    """The line and column (0-based) of the event's k-th character."""
    before = event.raw[:k]
    if "\n" not in before:
        return event.place[0], event.place[1] + k
    return event.place[0] + before.count("\n"), k - before.rfind("\n") - 1


def _raw_attributes(raw: str) -> list[tuple[str, tuple[int, int] | None]]:
    """Each attribute of a start tag as written: (name, span of its value in `raw` with its quotes, or None), found as
    html.parser's own `parse_starttag` finds them (its patterns), so the spans are those of the parser's attrs."""
    tagfind, attrfind = getattr(html.parser, "tagfind_tolerant", None), getattr(html.parser, "attrfind_tolerant", None)
    if tagfind is None or attrfind is None:
        return []
    found, match = [], tagfind.match(raw, 1)
    if not match:
        return []
    k = match.end()
    while k < len(raw):
        m = attrfind.match(raw, k)
        if not m or m.end() == k:
            break
        found.append((m.group(1).lower(), m.span(3) if m.group(3) is not None else None))
        k = m.end()
    return found


# =============================================================================================================
# Text as written and as read
# =============================================================================================================

# html.unescape's own pattern: a character reference, as the parser decoded it.
_CHARREF = re.compile(r"&(#[0-9]+;?|#[xX][0-9a-fA-F]+;?|[^\t\n\f <&#;]{1,32};?)")
_SURROGATES = re.compile("[\udc80-\udcff]")
_SPACE_BREAKS = str.maketrans({c: " " for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"})


class _Text:
    """A text event: as written (`raw`) and as read (`text`: entities decoded, line breaks made spaces), with where
    each character reference lies, so a range of the text read gives back the bytes written."""

    def __init__(self, raw: str, text: str) -> None:
        self.raw, self.text = raw, text.translate(_SPACE_BREAKS)
        self.refs: list[tuple[int, int, int, int]] = []  # (text start, text end, raw start, raw end)
        if "&" in raw:
            shift = 0
            for m in _CHARREF.finditer(raw):
                decoded = html.unescape(m.group())
                start = m.start() - shift
                self.refs.append((start, start + len(decoded), m.start(), m.end()))
                shift += len(m.group()) - len(decoded)

    def raw_slice(self, a: int, b: int) -> str:
        """The source's characters for text[a:b] (a reference cut by a or b: its characters escaped)."""
        if not self.refs:
            return self.raw[a:b]

        def to_raw(i: int) -> int | None:
            shift = 0
            for t0, t1, r0, r1 in self.refs:
                if i <= t0:
                    break
                if i < t1:
                    return None
                shift += (r1 - r0) - (t1 - t0)
            return i + shift

        ra, rb = to_raw(a), to_raw(b)
        if ra is None or rb is None:
            return _escape(self.text[a:b])
        return self.raw[ra:rb]


def _escape(text: str) -> str:
    return html.escape(text, quote=False)


def _escape_attribute(text: str, quote: str) -> str:
    text = _escape(text)  # and only the quote the value is written in
    return text.replace('"', "&quot;") if quote != "'" else text.replace("'", "&#x27;")


# =============================================================================================================
# A start tag whose attributes are translated
# =============================================================================================================


class _Tag:
    """A tag as written; a start tag's translated attributes (`values`: span in raw, quote, sentence ids and pieces)
    and its `lang` replaced when rendered."""

    def __init__(self, raw: str) -> None:
        self.raw = raw
        self.values: list[tuple[tuple[int, int], str, list]] = []

    def render(self, found: dict[int, Aligned]) -> str:
        if not self.values:
            return self.raw
        out, at = [], 0
        for (a, b), quote, pieces in sorted(self.values, key=lambda v: v[0]):
            text = "".join(found[p][0] if isinstance(p, int) else p for p in pieces)
            out.append(self.raw[at:a])
            q = quote or '"'
            out.append(q + _escape_attribute(text, q) + q)
            at = b
        out.append(self.raw[at:])
        return "".join(out)


# =============================================================================================================
# Blocks: text with inline tags, translated and rendered
# =============================================================================================================


@dataclasses.dataclass
class _Element:
    name: str
    place: tuple[int, int]
    parent: int | None
    a: int  # where its content starts in the block's text
    b: int = -1  # where it ends (-1: not closed)
    kind: str = "inline"  # inline, void, opaque
    open_atom: int = -1
    close_atom: int = -1
    raw: str = ""  # an opaque element's whole source


@dataclasses.dataclass
class _Atom:
    kind: str  # text, open, close, void, opaque, boundary (a tag the text is cut at)
    at: int  # position in the block's text (text: its start)
    end: int = 0  # text and opaque: end in the block's text
    text: _Text | None = None
    tag: _Tag | None = None
    element: int = -1


class _Block:
    """A block's inline content: atoms in source order, the text read (`text`), its inline elements."""

    def __init__(self) -> None:
        self.atoms: list[_Atom] = []
        self.parts: list[str] = []
        self.length = 0
        self.elements: list[_Element] = []
        self.open: list[int] = []  # inline elements open, innermost last
        self.sentences: list[tuple[int, int, int]] = []  # (start, end, sentence id)
        self.opaque_inside: int = -1  # an opaque element being read (its element id)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add_text(self, raw: str, data: str) -> None:
        t = _Text(raw, data)
        self.atoms.append(_Atom("text", self.length, self.length + len(t.text), text=t))
        self.parts.append(t.text)
        self.length += len(t.text)

    def add_tag(self, kind: str, tag: _Tag, element: int = -1) -> None:
        self.atoms.append(_Atom(kind, self.length, tag=tag, element=element))


def _words(text: str, base: int = 0) -> list[tuple[int, int]]:
    return [(base + m.start(), base + m.end()) for m in re.finditer(r"\S+", text)]


class _Placer:
    """One translated sentence's inline tags: where each goes in the translation, by the word alignment."""

    def __init__(self, block: _Block, start: int, end: int, target: str, pairs, report: MarkupReport) -> None:
        self.block, self.start, self.end, self.target, self.report = block, start, end, target, report
        self.source_words = _words(block.text[start:end], start)
        self.target_words = _words(target)
        self.aligned: dict[int, set[int]] = {}
        if pairs is not None:
            for i, j in pairs:
                if 0 <= i < len(self.source_words) and 0 <= j < len(self.target_words):
                    self.aligned.setdefault(i, set()).add(j)
        self.has_alignment = pairs is not None

    def targets(self, a: int, b: int) -> set[int]:
        """The target words aligned to the source words that overlap [a, b) of the block's text."""
        out: set[int] = set()
        for i, (s, e) in enumerate(self.source_words):
            if s < b and e > a:
                out |= self.aligned.get(i, set())
        return out

    def span(self, a: int, b: int, what: _Element) -> tuple[int, int]:
        """[start, end) in the target of the words aligned to [a, b): the smallest span holding them (reported where
        other words come between); without an alignment, the whole sentence. Where none of its words is
        translated, an empty span where they would be (reported). `exact`: whether it was placed exactly."""
        self.exact = False
        words = sorted(self.targets(a, b))
        if not words:
            if not self.has_alignment:
                if what.kind == "opaque":  # it would replace the whole translation: before it or after it instead
                    p = 0 if not self.block.text[self.start : a].strip() else len(self.target)
                    return p, p
                return 0, len(self.target)
            self.report.not_placed(what.place, f"<{what.name}>: no word of the translation is aligned to its words; "
                                               f"it stays where they would be")  # fmt: skip
            p = self.point(a)
            return p, p
        shared = what.kind == "opaque" and self.shared_side(a, b)
        if shared:
            self.report.not_placed(what.place, f"<{what.name}>: part of a word; it goes beside that word's translation")
        elif words != list(range(words[0], words[-1] + 1)):
            self.report.not_placed(
                what.place, f"<{what.name}>: its words' translations are not together; it wraps the span holding them"
            )
        else:
            self.exact = True
        lo, hi = self.target_words[words[0]][0], self.target_words[words[-1]][1]
        if shared:  # its translation holds the word's other letters: kept, the element put before or after it
            return (hi, hi) if shared == "before" else (lo, lo)
        # Marks the tag left out of its first or last word ("<b>dog</b>.") are left out of the translation's too.
        text = self.block.text
        first = next(w for w in self.source_words if w[1] > a)
        last = [w for w in self.source_words if w[0] < b][-1]
        before, after = text[first[0] : max(a, first[0])], text[min(b, last[1]) : last[1]]
        if (
            before
            and not any(c.isalnum() for c in before)
            and self.target.startswith(before, lo)
            and hi - lo > len(before)
        ):
            lo += len(before)
        if (
            after
            and not any(c.isalnum() for c in after)
            and self.target.endswith(after, lo, hi)
            and hi - lo > len(after)
        ):
            hi -= len(after)
        return lo, hi

    def shared_side(self, a: int, b: int) -> str | None:
        """Where the words overlapping [a, b) hold letters or digits outside it ("before" it, "after" it), else None:
        an opaque element that is part of a word cannot replace that word's translation."""
        text = self.block.text
        first = next((w for w in self.source_words if w[1] > a), None)
        last = next((w for w in reversed(self.source_words) if w[0] < b), None)
        if first is None or last is None:
            return None
        if any(c.isalnum() for c in text[first[0] : a]):
            return "before"
        if any(c.isalnum() for c in text[b : last[1]]):
            return "after"
        return None

    def point(self, p: int) -> int:
        """Where a tag at `p` of the source goes: after the last target word aligned to a source word before p."""
        if not self.has_alignment:
            return len(self.target)
        best = -1
        for i, (_, e) in enumerate(self.source_words):
            if e <= p and self.aligned.get(i):
                best = max(self.aligned[i])
        if best < 0:
            return 0
        return self.target_words[best][1]


# =============================================================================================================
# Walking the events
# =============================================================================================================


class _Walker:
    """Turns events into output items: text as written (str), tags (`_Tag`) and blocks (`_Block`), each sentence
    to translate added to `sources`."""

    def __init__(self, rules: Rules, report: MarkupReport, segmenter, target_language: str | None) -> None:
        self.rules, self.report, self.segmenter, self.target = rules, report, segmenter, target_language
        self.items: list = []
        self.sources: dict[int, str] = {}  # sentences waiting for their translation, by id
        self.next_id = 0
        self.block_first_id = 0  # the first id the open block's tags may use
        self.block: _Block | None = None
        self.stack: list[str] = []  # every element open (for the nesting limit and stray end tags)
        self.raw_until: tuple[str, int] | None = None  # inside an untouched element: (name, depth)
        self.raw_place = (1, 0)  # where the untouched element being read starts
        self.opaque: tuple[str, int, list] | None = None  # inside an opaque inline element: (name, depth, raws)

    # --- output items ---------------------------------------------------------------------------------------

    def queue(self, sentence: str) -> int:
        """A sentence to translate (bytes that were not UTF-8 read as U+FFFD), by its id."""
        self.sources[self.next_id] = _SURROGATES.sub("\ufffd", sentence)
        self.next_id += 1
        return self.next_id - 1

    def new_block(self) -> _Block:
        self.block, self.block_first_id = _Block(), self.next_id
        return self.block

    def raw(self, text: str) -> None:
        self.items.append(text)  # (joined when written: no string grows a piece at a time)

    def item(self, tag: _Tag) -> None:
        """A tag outside a block: as written where it has nothing to translate (the items stay plain strings)."""
        self.items.append(tag if tag.values else tag.raw)

    def end_block(self) -> None:
        block, self.block = self.block, None
        if block is None:
            return
        for element_id in block.open:  # inline tags still open where the block ends: the text is cut there
            element = block.elements[element_id]
            block.atoms[element.open_atom].kind = "boundary"
            self.report.repair(element.place, f"<{element.name}> not closed in its block: the text is translated in "
                                              f"parts around it")  # fmt: skip
        block.open = []
        self.segment(block)
        if block.sentences or any(atom.tag is not None and atom.tag.values for atom in block.atoms):
            self.items.append(block)
        else:  # nothing to translate in it (whitespace between blocks): as written, now
            self.items.append(_render_block(block, {}, self.report))

    # --- events ---------------------------------------------------------------------------------------------

    def tag(self, event: _Event, translate: bool = True) -> _Tag:
        """The tag as written, its attributes checked against the limit and, with `translate`, its translatable
        attributes queued (`rules.attributes`, `rules.lang`)."""
        tag = _Tag(event.raw)
        if event.kind == "end":
            return tag
        for name, value in event.attrs:
            if value is not None and len(value) > self.rules.max_attribute:
                raise DataError(
                    f"{self.report.origin}, line {event.place[0]}, column {event.place[1] + 1}: attribute {name!r} "
                    f"of <{event.name}> has {len(value)} characters, over the limit of {self.rules.max_attribute}"
                )
        wanted = {
            n for n, v in event.attrs if v and (n in self.rules.attributes or (n in self.rules.lang and self.target))
        }
        if not translate or not wanted or self.raw_until or self.opaque:
            return tag
        values = dict((n, v) for n, v in event.attrs)
        for name, span in _raw_attributes(event.raw):
            if name not in wanted or span is None:
                continue
            a, b = span
            quote = event.raw[a] if event.raw[a] in "'\"" else ""
            if name in self.rules.lang:
                tag.values.append(((a, b), quote, [self.target]))
                continue
            pieces = []
            value = _SURROGATES.sub("\ufffd", values[name].translate(_SPACE_BREAKS))  # what the model reads
            for piece in self.segmenter.split(value):
                if piece.sentence:
                    pieces.append(self.queue(piece.text))
                    self.report.attributes += 1
                else:
                    pieces.append(piece.text)
            tag.values.append(((a, b), quote, pieces))
        return tag

    def opaque_attrs(self, event: _Event) -> bool:
        attrs = {n: (v or "") for n, v in event.attrs}
        return (
            event.name in self.rules.opaque
            or attrs.get("translate", "").strip().lower() == "no"
            or "notranslate" in attrs.get("class", "").split()
            or attrs.get("its:translate", "").strip().lower() == "no"
        )

    def push(self, event: _Event) -> None:
        name = event.name
        if name in _OPTIONAL_END and not self.rules.xml:
            for i in range(len(self.stack) - 1, -1, -1):  # a new <li> closes the open one (HTML's implied ends)
                if self.stack[i] == name:
                    del self.stack[i:]
                    break
                if self.stack[i] not in self.rules.inline:
                    break
        self.stack.append(name)
        if len(self.stack) > self.rules.max_depth:
            raise DataError(
                f"{self.report.origin}, line {event.place[0]}, column {event.place[1] + 1}: <{name}> is nested "
                f"{len(self.stack)} elements deep, over the limit of {self.rules.max_depth}"
            )

    def pop(self, event: _Event) -> bool:
        """Closes the innermost open element of the event's name; False where none is open (a stray end tag)."""
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i] == event.name:
                del self.stack[i:]
                return True
        return False

    def event(self, event: _Event) -> None:
        if self.raw_until is not None:
            self.in_untouched(event)
        elif self.opaque is not None:
            self.in_opaque(event)
        elif event.kind == "data":
            self.data(event)
        elif event.kind == "other":
            self.other(event)
        elif event.kind == "end":
            self.end_tag(event)
        else:
            self.start_tag(event)

    def in_untouched(self, event: _Event) -> None:
        """Inside an untouched element: everything as written until its end tag."""
        until, depth = self.raw_until
        if event.kind == "start" and event.name == until:
            self.raw_until = (until, depth + 1)
        elif event.kind == "end" and event.name == until:
            self.raw_until = None if depth == 1 else (until, depth - 1)
            if depth == 1:
                self.pop(event)
        self.raw(event.raw)

    def in_opaque(self, event: _Event) -> None:
        """Inside an opaque inline element: its source gathered, its text read."""
        until, depth, raws = self.opaque
        raws.append(event.raw)
        if event.kind == "data":
            self.block.add_text("", event.data)
            self.block.atoms[-1].kind = "opaque-text"
        if event.kind == "start" and event.name == until:
            self.opaque = (until, depth + 1, raws)
        elif event.kind == "end" and event.name == until:
            if depth > 1:
                self.opaque = (until, depth - 1, raws)
            else:
                self.pop(event)
                self.close_opaque()

    def close_opaque(self) -> None:
        """The opaque element being read ends here (its end tag, or the input's end)."""
        block = self.block
        element = block.elements[block.opaque_inside]
        element.b, element.raw = block.length, "".join(self.opaque[2])
        block.atoms.append(_Atom("opaque", element.a, block.length, element=block.opaque_inside))
        block.opaque_inside = -1
        self.opaque = None

    def data(self, event: _Event) -> None:
        if self.block is None and event.raw.isspace():  # whitespace between blocks: as written
            self.raw(event.raw)
            return
        if self.block is None:
            self.new_block()
        if self.block.length > BLOCK_CHARS and not self.block.open:
            self.report.repair(event.place, f"a block longer than {BLOCK_CHARS} characters: cut here")
            self.end_block()
            self.new_block()
        self.block.add_text(event.raw, event.data)
        if "<" in event.raw and not self.rules.xml:  # a literal '<' ("&lt;" is no repair)
            self.report.repair(_place_in(event, event.raw.find("<")), "a '<' that opens no tag: read as text")

    def other(self, event: _Event) -> None:
        if event.name == "!skipped":  # "</>", which the parser drops: kept as written, the text cut at it
            self.report.repair(event.place, f"{event.raw!r} is no tag: kept as it is")
            if self.block is not None:
                self.block.add_tag("boundary", _Tag(event.raw))
                return
        self.end_block()
        self.raw(event.raw)

    def start_tag(self, event: _Event) -> None:
        kind, name = event.kind, event.name
        inline = name in self.rules.inline or name in self.rules.opaque
        opaque = self.opaque_attrs(event)
        void = kind == "startend" or name in self.rules.void
        if name in self.rules.untouched or (opaque and not inline and not void):
            self.end_block()
            self.raw(self.tag(event, translate=False).raw)  # its attributes as written, as its content
            if kind == "start" and name not in self.rules.void:
                self.push(event)
                self.raw_until, self.raw_place = (name, 1), event.place
            return
        if not inline:
            self.end_block()
            self.item(self.tag(event, translate=not opaque))  # translate="no": its attributes too
            if kind == "start" and name not in self.rules.void:
                self.push(event)
            return
        block = self.block or self.new_block()
        parent = block.open[-1] if block.open else None
        if void:
            block.elements.append(_Element(name, event.place, parent, block.length, block.length, "void"))
            block.elements[-1].open_atom = len(block.atoms)
            block.add_tag("void", self.tag(event, translate=not opaque), len(block.elements) - 1)
            return
        if opaque:
            block.elements.append(_Element(name, event.place, parent, block.length, kind="opaque"))
            block.opaque_inside = len(block.elements) - 1
            self.opaque = (name, 1, [self.tag(event, translate=False).raw])
            self.push(event)
            return
        self.push(event)
        block.elements.append(_Element(name, event.place, parent, block.length))
        block.elements[-1].open_atom = len(block.atoms)
        block.open.append(len(block.elements) - 1)
        block.add_tag("open", self.tag(event), len(block.elements) - 1)

    def end_tag(self, event: _Event) -> None:
        name, block = event.name, self.block
        if name in self.rules.inline and block is not None and any(block.elements[e].name == name for e in block.open):
            while True:
                element_id = block.open.pop()
                element = block.elements[element_id]
                if element.name == name:
                    break
                block.atoms[element.open_atom].kind = "boundary"  # misnested: cut the text at its start tag
                self.report.repair(element.place, f"<{element.name}> closed by </{name}> (misnested): the text is "
                                                  f"translated in parts around it")  # fmt: skip
            element.b, element.close_atom = block.length, len(block.atoms)
            block.add_tag("close", self.tag(event), element_id)
            self.pop(event)
            return
        if not self.pop(event):
            self.report.repair(event.place, f"</{name}> closes no open element: kept as it is")
        if name in self.rules.inline and block is not None:  # stray, or its start tag was in an earlier block
            block.add_tag("boundary", self.tag(event))
            return
        self.end_block()
        self.item(self.tag(event))

    # --- sentences ------------------------------------------------------------------------------------------

    def segment(self, block: _Block) -> None:
        """The block's sentences (queued in `sources`): its text cut by the segmenter, opaque content read as one
        word, and at boundaries (tags the text is cut at); a sentence wholly inside opaque content is kept."""
        text = block.text
        if not text.strip():
            return
        # What the splitter (and the model) reads: bytes not UTF-8 as U+FFFD.
        view = list(_SURROGATES.sub("\ufffd", text))
        opaque = [(e.a, e.b) for e in block.elements if e.kind == "opaque" and e.b > e.a]
        for a, b in opaque:
            view[a:b] = "x" * (b - a)  # no sentence ends inside code
        view = "".join(view)
        cuts = sorted({atom.at for atom in block.atoms if atom.kind == "boundary"} | {0, len(text)})
        for lo, hi in zip(cuts, cuts[1:]):
            at = lo
            for piece in documents.stream_pieces([view[lo:hi]], self.segmenter):
                if piece.sentence:
                    s, e = at, at + len(piece.text)
                    found = text[s:e]  # spaces at its edges may be an opaque element's (read as "x" above)
                    s, e = s + len(found) - len(found.lstrip()), s + len(found.rstrip())
                    if e > s and not any(a <= s and e <= b for a, b in opaque):
                        block.sentences.append((s, e, self.queue(text[s:e])))
                        self.report.sentences += 1
                at += len(piece.text)
        self.report.blocks += 1


# =============================================================================================================
# Rendering a block
# =============================================================================================================


def _render_block(block: _Block, found: dict[int, Aligned], report: MarkupReport) -> str:
    """The block with each sentence replaced by its translation (its inline tags placed in it) and every other
    character and tag as written."""
    sentences = block.sentences
    if not sentences:
        return "".join(_atom_raw(atom, block, found) for atom in block.atoms if atom.kind != "opaque-text")
    elements = block.elements
    starts = [s for s, _, _ in sentences]

    def holder(x: int) -> int | None:
        """The sentence that holds position x (its start included), None where it lies between two."""
        k = bisect.bisect_right(starts, x) - 1
        return k if k >= 0 and x < sentences[k][1] else None

    # Which tags go into a sentence's translation (placed by alignment) and which stay where they are.
    inside: dict[int, int] = {}  # element id -> the sentence whose translation holds its start tag
    closes: dict[int, int] = {}  # element id -> the sentence whose translation holds its end tag
    voids: dict[int, int] = {}  # void or empty element id -> the sentence whose translation holds it
    for i, el in enumerate(elements):
        if el.kind == "void" or (el.kind != "opaque" and el.a == el.b >= 0):  # a point (an empty element too)
            k = holder(el.a)
            if k is not None and sentences[k][0] < el.a:
                voids[i] = k
                if el.kind != "void":
                    inside[i] = closes[i] = k
        elif el.b < 0:  # not closed: its tags stay where they are
            continue
        elif el.kind == "opaque":  # the last sentence it overlaps without covering it whole
            first = max(bisect.bisect_right(starts, el.a) - 1, 0)
            for k in range(first, bisect.bisect_left(starts, el.b)):
                s, e, _ = sentences[k]
                if el.a < e and el.b > s and not (el.a <= s and el.b >= e):
                    inside[i] = closes[i] = k
        else:
            k = holder(el.a)  # its start tag, where the sentence holding it does not start with it (or goes on)
            if k is not None and (sentences[k][0] < el.a or el.b < sentences[k][1]):
                inside[i] = k
            k = bisect.bisect_left(starts, el.b) - 1  # its end tag: the last sentence that starts before it
            if k >= 0 and (el.b < sentences[k][1] or (el.b == sentences[k][1] and el.a > sentences[k][0])):
                closes[i] = k
    _keep_edge_order(block, sentences, inside, closes)
    members: dict[int, list[int]] = {}  # sentence -> the elements placed in it, in source order
    for i in sorted(set(inside) | set(closes) | set(voids)):
        for k in sorted({placed.get(i) for placed in (inside, closes, voids)} - {None}):
            members.setdefault(k, []).append(i)

    def sentence(k: int) -> str:
        return _Sentence(block, k, found, members.get(k, []), inside, closes, voids, report).render()

    out = []
    k_next = 0
    for atom in block.atoms:
        if atom.kind == "opaque-text":
            continue
        if atom.kind == "text":
            a, b = atom.at, atom.end
            pos = a
            while pos < b:
                k = holder(pos)
                if k is None:
                    later = bisect.bisect_right(starts, pos)
                    nxt = min(starts[later], b) if later < len(starts) else b
                    out.append(atom.text.raw_slice(pos - a, nxt - a))
                    pos = nxt
                else:
                    s, e, _ = sentences[k]
                    if k >= k_next:
                        out.append(sentence(k))
                        k_next = k + 1
                    pos = min(e, b)
            continue
        if atom.kind == "opaque":
            if atom.element in inside:  # written by its sentence (which may hold no other text)
                if inside[atom.element] >= k_next:
                    out.append(sentence(inside[atom.element]))
                    k_next = inside[atom.element] + 1
                continue
            out.append(elements[atom.element].raw)
            continue
        if atom.kind == "open" and atom.element in inside:
            continue
        if atom.kind == "close" and atom.element in closes:
            continue
        if atom.kind == "void" and atom.element in voids:
            continue
        out.append(atom.tag.render(found))
    if k_next != len(sentences):
        raise AssertionError(f"sentences {k_next}..{len(sentences) - 1} of a block were not written")
    return "".join(out)


def _keep_edge_order(block: _Block, sentences: list[tuple[int, int, int]], inside: dict, closes: dict) -> None:
    """Tags between two runs of text keep their source order. At a sentence's edge, the end tags the sentence
    before writes in its translation come first, then the tags that stay where they are, then the start tags the
    sentence after writes; a tag that would cross one of another kind stays where it is instead."""
    ends = {e: k for k, (_, e, _) in enumerate(sentences)}
    begins = {s: k for k, (s, _, _) in enumerate(sentences)}

    def settle(group: list[_Atom]) -> None:
        if not group:
            return
        before, after = ends.get(group[0].at), begins.get(group[0].at)
        if before is None and after is None:  # inside a sentence, or between two with whitespace around
            return
        slots = []  # 0: the sentence before writes it; 1: it stays; 2: the sentence after writes it
        for atom in group:
            if atom.kind == "close" and before is not None and closes.get(atom.element) == before:
                slots.append(0)
            elif atom.kind == "open" and after is not None and inside.get(atom.element) == after:
                slots.append(2)
            else:
                slots.append(1)
        for n in range(len(slots)):  # an end tag after one that stays stays; a start tag before one stays
            if slots[n] == 0 and max(slots[:n], default=0) >= 1:
                slots[n] = 1
                del closes[group[n].element]
        for n in reversed(range(len(slots))):
            if slots[n] == 2 and min(slots[n + 1 :], default=2) <= 1:
                slots[n] = 1
                del inside[group[n].element]

    group: list[_Atom] = []
    for atom in block.atoms:
        if atom.kind in ("open", "close", "void", "boundary"):
            group.append(atom)
        elif atom.kind == "opaque" or atom.end > atom.at:  # text, or an opaque element: the tags around it apart
            settle(group)
            group = []
    settle(group)


def _atom_raw(atom: _Atom, block: _Block, found) -> str:
    if atom.kind == "text":
        return atom.text.raw
    if atom.kind == "opaque":
        return block.elements[atom.element].raw
    return atom.tag.render(found)


class _Sentence:
    """Sentence k of a block rendered: its translation, escaped, with the inline tags placed in it. Each element's
    span comes from the words aligned to its words (`_Placer`); the spans are then made to nest (`settle`: a child
    inside its parent, siblings apart) and written out (`emit`)."""

    def __init__(self, block: _Block, k: int, found: dict[int, Aligned], members: list[int], inside, closes, voids,
                 report: MarkupReport) -> None:  # fmt: skip
        s, e, sid = block.sentences[k]
        target, pairs = found[sid]
        self.target = documents.LINE_BREAK.sub(" ", target)
        self.block, self.k, self.found, self.report = block, k, found, report
        self.opens = {i for i in members if inside.get(i) == k}  # elements whose start tag this sentence writes
        self.closes = {i for i in members if closes.get(i) == k}  # elements whose end tag it writes
        self.aligned = pairs is not None
        if pairs is None:
            report.unaligned += 1
        placer = _Placer(block, s, e, self.target, pairs, report)
        elements = block.elements
        self.spans: dict[int, tuple[int, int]] = {}  # element id -> [start, end) in the target
        self.inexact: set[int] = set()  # elements not placed exactly (each reported once)
        self.cuts: list[tuple[int, int]] = []  # target text an opaque element replaced before it had to move
        for i in members:  # source order: parents before children
            el = elements[i]
            if voids.get(i) == k:
                p = placer.point(el.a)
                self.spans[i] = (p, p)
            else:
                lo, hi = placer.span(max(el.a, s), min(el.b, e), el)
                self.spans[i] = (lo if i in self.opens else 0, hi if i in self.closes else len(self.target))
                if not placer.exact:
                    self.inexact.add(i)
        self.kids: dict[int | None, list[int]] = {}  # placed element (None: the sentence) -> its placed children
        for i in self.spans:
            parent = elements[i].parent
            while parent is not None and parent not in self.spans:
                parent = elements[parent].parent
            self.kids.setdefault(parent, []).append(i)

    def render(self) -> str:
        self.settle(None, 0, len(self.target))
        if self.aligned:
            self.report.placed += len(self.spans.keys() - self.inexact)
        out: list[str] = []
        self.emit(None, 0, len(self.target), out)
        return "".join(out)

    def not_placed(self, i: int, what: str) -> None:
        if i not in self.inexact:
            self.inexact.add(i)
            self.report.not_placed(self.block.elements[i].place, f"<{self.block.elements[i].name}>: {what}")

    def settle(self, parent: int | None, lo_frame: int, hi_frame: int) -> None:
        """The spans of `parent`'s children made to lie inside [lo_frame, hi_frame), apart and in the source's
        order, so the tags come out in the input's sequence: a child whose words' translation begins before an
        earlier sibling's end follows that sibling, a point lies between its neighbours (reported); then theirs."""
        spans, elements = self.spans, self.block.elements
        mine = self.kids.get(parent, [])  # source order
        for i in mine:  # inside the parent
            lo, hi = spans[i]
            lo = min(max(lo, lo_frame), hi_frame)
            spans[i] = (lo, min(max(hi, lo), hi_frame))
        wide = {i for i in mine if spans[i][1] > spans[i][0]}
        end, last = lo_frame, None
        for i in [i for i in mine if i in wide]:
            lo, hi = spans[i]
            if not self.aligned and last is not None and spans[last] == (lo, hi) and "opaque" not in (
                elements[i].kind, elements[last].kind):  # fmt: skip
                mine.remove(i)  # without an alignment every tag wraps the whole sentence: nested
                wide.discard(i)
                self.kids.setdefault(last, []).append(i)
                continue
            if lo < end:
                self.not_placed(i, "its words' translation begins before an earlier tag's end; it follows that tag")
                if elements[i].kind == "opaque":  # the words it replaces go with it
                    space = hi < len(self.target) and self.target[hi] == " " and (lo == 0 or self.target[lo - 1] == " ")
                    self.cuts.append((lo, hi + space))
                    hi = end
                spans[i] = (end, max(hi, end))
            end, last = spans[i][1], i
        before = lo_frame
        for n, i in enumerate(mine):
            if i in wide:
                before = spans[i][1]
                continue
            after = next((spans[j][0] for j in mine[n + 1 :] if j in wide), hi_frame)
            p = min(max(spans[i][0], before), after)
            if p != spans[i][0] and self.aligned:
                self.not_placed(i, "it goes between the tags around it, as in the source")
            spans[i] = (p, p)
            before = p
        for i in mine:
            if spans[i][1] > spans[i][0]:
                self.settle(i, *spans[i])

    def text(self, a: int, b: int) -> str:
        """The target's [a, b), escaped, without what a moved opaque element replaced."""
        if not self.cuts:
            return _escape(self.target[a:b])
        return _escape(
            "".join(c for n, c in enumerate(self.target[a:b], a) if not any(x <= n < y for x, y in self.cuts))
        )

    def emit(self, parent: int | None, lo_frame: int, hi_frame: int, out: list[str]) -> None:
        """`parent`'s part of the target, [lo_frame, hi_frame), with its children's tags, into `out`."""
        spans, elements, atoms = self.spans, self.block.elements, self.block.atoms
        at = lo_frame
        for i in self.kids.get(parent, []):  # in the source's order, which `settle` kept
            lo, hi = spans[i]
            el = elements[i]
            out.append(self.text(at, lo))
            if el.kind == "opaque":
                out.append(el.raw)
            elif el.kind == "void":
                out.append(atoms[el.open_atom].tag.render(self.found))
            else:
                if i in self.opens:
                    out.append(atoms[el.open_atom].tag.render(self.found))
                self.emit(i, lo, hi, out)
                if i in self.closes:
                    out.append(atoms[el.close_atom].tag.render(self.found))
            at = max(at, hi)
        out.append(self.text(at, hi_frame))


# =============================================================================================================
# Translating a document
# =============================================================================================================


def translate_markup(
    chunks: Iterable[str],
    write: Callable[[str], None],
    translate: TranslateFn,
    *,
    rules: Rules | None = None,
    segmenter: documents.Segmenter | None = None,
    target_language: str | None = None,
    report: MarkupReport | None = None,
    chunk_sentences: int = documents.CHUNK_SENTENCES,
    pending_chars: int = documents.PENDING_CHARS,
) -> MarkupReport:
    """Translates a document of HTML (or XML: `rules`) that comes as `chunks` of text (`read_markup`) and calls
    `write(text)` with it translated, in order: each block's sentences replaced by their translations (`translate`:
    sentences to (translation, word pairs)), inline tags placed by the pairs, `rules.attributes` translated,
    `rules.lang` attributes set to `target_language`, every other character as it was. At most `chunk_sentences`
    sentences wait for their translation (more only where one block holds more), and what was read is written at
    least every `pending_chars` characters; a block's text is held whole (at most BLOCK_CHARS). `translate` must give
    one answer for each sentence (a ValueError says so otherwise)."""
    rules = rules or Rules()
    report = report or MarkupReport()
    report.kind = "xml" if rules.xml else "html"
    segmenter = segmenter or documents.Segmenter("en")
    tokenizer = _Tokenizer(rules.xml)
    walker = _Walker(rules, report, segmenter, target_language)
    found: dict[int, Aligned] = {}
    buffer, buffer_start = "", 0  # the source from the first event not yet read

    def flush() -> None:
        """Translates what waits and writes the items that are done (the open block's tags keep their ids)."""
        if walker.sources:
            ids = list(walker.sources)
            answers = translate([walker.sources[i] for i in ids])
            if len(answers) != len(ids):
                raise ValueError(f"the translate function gave {len(answers)} translations of {len(ids)} sentences")
            found.update(zip(ids, answers))
            walker.sources = {}
        if walker.items:
            write("".join(_render(item, found, report) for item in walker.items))
            walker.items = []
        keep = walker.block_first_id if walker.block is not None else walker.next_id
        for i in [i for i in found if i < keep]:
            del found[i]

    waiting = [0]  # characters read since the last flush

    def take(events: list[_Event], ends: list[int]) -> None:
        for event, end in zip(events, ends):
            event.raw = buffer[event.start - buffer_start : end - buffer_start]
            walker.event(event)
            waiting[0] += end - event.start
            if len(walker.sources) >= chunk_sentences or waiting[0] >= pending_chars:
                flush()  # a long run of markup without sentences is written as it goes too
                waiting[0] = 0

    first = True
    for chunk in chunks:
        if first and chunk:
            first = False
            if chunk.startswith("\ufeff"):  # a UTF-8 byte-order mark: written as it is, never translated
                walker.raw("\ufeff")
                chunk = chunk[1:]
        buffer += chunk
        tokenizer.feed(chunk)
        events = tokenizer.events
        if len(events) > 1:  # every event but the last is whole: it ends where the next begins
            done, tokenizer.events = events[:-1], events[-1:]
            take(done, [e.start for e in events[1:]])
            keep = tokenizer.events[0].start
            buffer, buffer_start = buffer[keep - buffer_start :], keep
            tokenizer.forget_lines()
    tokenizer.close()
    events = tokenizer.events
    take(events, [e.start for e in events[1:]] + [tokenizer.fed])
    if walker.raw_until is not None:
        report.repair(walker.raw_place, f"<{walker.raw_until[0]}> not closed: the rest of the input is kept as it is")
    if walker.opaque is not None:  # an opaque element not closed: it runs to the end, after the block's text
        block = walker.block
        element = block.elements[block.opaque_inside]
        report.repair(element.place, f"<{element.name}> not closed: the rest of the input is carried as it is")
        text = block.text[: element.a]
        block.atoms = [atom for atom in block.atoms if atom.kind != "opaque-text" or atom.at < element.a]
        block.parts, block.length, block.opaque_inside = [text], len(text), -1
        raws, walker.opaque = walker.opaque[2], None
        walker.end_block()
        walker.raw("".join(raws))
    walker.end_block()
    flush()
    return report


def _render(item, found: dict[int, Aligned], report: MarkupReport) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, _Tag):
        return item.render(found)
    return _render_block(item, found, report)


def translate_markup_text(text: str, translate: TranslateFn, **kwargs) -> tuple[str, MarkupReport]:
    """`translate_markup` of one text in memory: (the translated text, the report)."""
    written: list[str] = []
    report = translate_markup([text], written.append, translate, **kwargs)
    return "".join(written), report


class Prepared:
    """A text of markup read, its sentences known before any is translated (a service awaits their translations
    between the two halves): `sentences`, then `render(translations)` gives the text and fills `report`."""

    def __init__(self, text: str, **kwargs) -> None:
        self._asked: list[str] = []
        self._answers: list[Aligned] | None = None

        def collect(sentences: list[str]) -> list[Aligned]:
            if self._answers is None:
                self._asked.extend(sentences)
                return [("", None)] * len(sentences)
            answers, self._answers = self._answers[: len(sentences)], self._answers[len(sentences) :]
            return answers

        self._text, self._kwargs, self._collect = text, kwargs, collect
        translate_markup([text], lambda _: None, collect, chunk_sentences=1 << 62, **kwargs)  # reads, checks
        self.sentences = list(self._asked)
        self.report = MarkupReport()

    def render(self, translations: Sequence[Aligned]) -> str:
        if len(translations) != len(self.sentences):
            raise ValueError(f"{len(self.sentences)} sentences, {len(translations)} translations")
        self._answers = list(translations)
        kwargs = {**self._kwargs, "report": MarkupReport(origin=self._kwargs.get("report", MarkupReport()).origin)}
        written: list[str] = []
        self.report = translate_markup([self._text], written.append, self._collect, chunk_sentences=1 << 62, **kwargs)
        return "".join(written)


# =============================================================================================================
# A model's translations with word pairs
# =============================================================================================================

_PIECE_MARKS = str.maketrans("", "", "\u2581")


def _word_letters(tokenizer, ids: Sequence[int], side: str, config) -> list[int]:
    """Non-space characters of each word of `ids` as the tokenizer cuts them (`alignment.word_indices`)."""
    words = alignment.word_indices(tokenizer, ids, side, config)
    counts = [0] * (max(words) + 1 if words else 0)
    for i, w in zip(ids, words):
        if w >= 0:
            piece = alignment._piece(tokenizer, int(i), side)
            counts[w] += len(piece.removesuffix("</w>").translate(_PIECE_MARKS).replace(" ", ""))
    return counts


def _to_spaces(letters: list[int], text: str) -> list[int] | None:
    """The whitespace-separated word of `text` each tokenizer word (`letters`: its non-space characters) begins in:
    the same word where both count as many (SentencePiece begins a word at each space, whatever its pieces spell,
    an unknown character included); else by their letters; None where those disagree too (a tokenizer that rewrites
    characters)."""
    spaced = [len(w) for w in text.split()]
    if len(letters) == len(spaced):
        return list(range(len(spaced)))
    if sum(letters) != sum(spaced):
        return None
    out, at, word, edge = [], 0, 0, spaced[0] if spaced else 0
    for n in letters:
        while word < len(spaced) - 1 and at >= edge:
            word += 1
            edge += spaced[word]
        out.append(word)
        at += n
    return out


def word_pairs(tokenizer, config, sentence: str, source_ids: Sequence[int], found: translation.Translation):
    """The best hypothesis's word alignment (Pharaoh pairs over the tokenizer's words) as (source word, target
    word) pairs over the whitespace-separated words of `sentence` and of the translation; None where it has none or
    the tokenizer's words do not add up to the text's letters (a tokenizer that rewrites characters)."""
    best = found.hypotheses[0] if found.hypotheses else None
    if best is None or best.alignment is None:
        return None
    source_map = _to_spaces(_word_letters(tokenizer, source_ids, "source", config), sentence)
    target_map = _to_spaces(_word_letters(tokenizer, best.tokens, "target", config), best.text)
    if source_map is None or target_map is None:
        return None
    pairs = set()
    for pair in best.alignment.split():
        i, j = map(int, pair.split("-"))
        if i < len(source_map) and j < len(target_map):
            pairs.add((source_map[i], target_map[j]))
    return sorted(pairs)


def aligned_translator(
    params, config, tokenizer, decode, *, glossary=None, batch_size: int | None = None, max_tokens: int | None = None
) -> TranslateFn:
    """A model's `TranslateFn`: sentences translated by `decode` with word alignments where its rules give them
    (beam and greedy search; none with sampling), the pairs mapped from the tokenizer's words to whitespace words."""
    aligned = not decode.do_sample  # a sample's tokens are drawn: its tags wrap whole sentences (reported)
    decode_aligned = dataclasses.replace(decode, alignments=True) if aligned else decode
    decode_aligned.aligned_layer(config)  # a ConfigError naming the field where the model has no such layer

    def run(sentences: list[str]) -> list[Aligned]:
        terms = None if glossary is None else [glossary.constraints(text) for text in sentences]
        sources = translation.encode_sources(tokenizer, sentences, config)  # once: the search and the pairs read them
        found = translation.translations(params, config, tokenizer, sentences, decode_aligned, batch_size=batch_size,
                                         max_tokens=max_tokens, progress=False, constraints=terms,
                                         encoded=sources)  # fmt: skip
        if not aligned:
            return [(result.text, None) for result in found]
        return [(result.text, word_pairs(tokenizer, config, sentence, ids, result))
                for sentence, ids, result in zip(sentences, sources, found)]  # fmt: skip

    return run


def check_usage(input_format: str, output_format: str, n_best: int) -> None:
    """Markup in, markup out: one translation of each sentence, written as the document."""
    if output_format != "text":
        raise UsageError(f"--input-format {input_format} writes the document, translated: it takes no --output-format "
                         f"{output_format}")  # fmt: skip
    if n_best > 1:
        raise UsageError(f"--input-format {input_format} writes one translation of each sentence: it takes no "
                         f"--n-best {n_best}")  # fmt: skip
