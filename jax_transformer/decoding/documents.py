"""Documents in, the layout kept: text of any size is cut into sentences and the whitespace between them, each
sentence is replaced by its translation, and every space, tab, line break and blank line is written back as it was.

- `Segmenter`: a text as pieces, separators (whitespace, kept byte for byte) and sentences (sentencex's, within each
  line; a sentence longer than the model takes is cut into parts that fit, at a clause mark, else a space).
- `read_blocks`: a file or binary stream as text, a block at a time (bad bytes named by line and byte offset).
- `translate_document`: blocks in, text out, in bounded memory: at most `carry_limit` characters of an unfinished
  line are held, however long the line, and sentences are translated a chunk at a time (`translation.translate`).
- `OutputText`: `translate_document`'s `write` into a file descriptor (stdout's).

The splitter is the optional `documents` extra (pip install -e '.[documents]'); this module imports without it.
"""

from __future__ import annotations

import codecs
import copy
import dataclasses
import os
import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

from tqdm.auto import tqdm

from jax_transformer.data.corpus import _check_readable
from jax_transformer.decoding import translation
from jax_transformer.errors import DataError, UsageError, WriteError
from jax_transformer.settings.config import DecodeConfig, TransformerConfig

# The splitter: sentencex (Wikimedia), maintained, ~300 languages with fallbacks, 100x pysbd's speed; pysbd's last
# release is from 2021 (benchmarks/splitters.py, docs/decoding.md#documents).
EXTRA = "pip install -e '.[documents]'"
BLOCK_BYTES = 1 << 16  # what `read_blocks` reads at a time
CARRY_LIMIT = 1 << 15  # characters of an unfinished line held at most (far above any model's sentence)
CHUNK_SENTENCES = 2048  # sentences translated together (sorted into batches by `translation.translate`)
PENDING_CHARS = 1 << 20  # characters waiting for their chunk's translations at most (long runs of whitespace)
MAX_REPORTED_CUTS = 10

# The line breaks of str.splitlines (CRLF as one); a document's lines and paragraphs are never inside a sentence.
LINE_BREAK = re.compile(r"\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")
_BREAK_CHARS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"
# Where a long sentence may be cut after a mark: a Latin clause mark before a space, or a full-width one anywhere.
_CLAUSE_END = re.compile(r"[,;:)\]—–…](?=\s)|[，、；：）」』]")
_WORD_END = re.compile(r"(?<=\S)\s")  # a space right after a word: the cut falls before it
_SPACES = re.compile(r"\s*")
_JOINERS = "\u200c\u200d\ufe0e\ufe0f"  # a cut never separates these from the character before them
_ASCII_SPACES = {c: " " for c in range(0x80, 0x3001) if chr(c).isspace()}  # U+00A0, U+2009, U+3000, ...


# =============================================================================================================
# Languages
# =============================================================================================================

# ISO 639-2/T and 639-3 codes (NLLB's `deu_Latn` begins with one) with an ISO 639-1 code, as sentencex reads them:
# every 639-1 language, then the individual languages NLLB names inside a macrolanguage (arb for ar, zsm for ms).
_ISO_639_1 = dict(
    pair.split(":")
    for pair in """aar:aa abk:ab ave:ae afr:af aka:ak amh:am arg:an ara:ar asm:as ava:av aym:ay aze:az bak:ba bel:be
    bul:bg bis:bi bam:bm ben:bn bod:bo bre:br bos:bs cat:ca che:ce cha:ch cos:co cre:cr ces:cs chu:cu chv:cv cym:cy
    dan:da deu:de div:dv dzo:dz ewe:ee ell:el eng:en epo:eo spa:es est:et eus:eu fas:fa ful:ff fin:fi fij:fj fao:fo
    fra:fr fry:fy gle:ga gla:gd glg:gl grn:gn guj:gu glv:gv hau:ha heb:he hin:hi hmo:ho hrv:hr hat:ht hun:hu hye:hy
    her:hz ina:ia ind:id ile:ie ibo:ig iii:ii ipk:ik ido:io isl:is ita:it iku:iu jpn:ja jav:jv kat:ka kon:kg kik:ki
    kua:kj kaz:kk kal:kl khm:km kan:kn kor:ko kau:kr kas:ks kur:ku kom:kv cor:kw kir:ky lat:la ltz:lb lug:lg lim:li
    lin:ln lao:lo lit:lt lub:lu lav:lv mlg:mg mah:mh mri:mi mkd:mk mal:ml mon:mn mar:mr msa:ms mlt:mt mya:my nau:na
    nob:nb nde:nd nep:ne ndo:ng nld:nl nno:nn nor:no nbl:nr nav:nv nya:ny oci:oc oji:oj orm:om ori:or oss:os pan:pa
    pli:pi pol:pl pus:ps por:pt que:qu roh:rm run:rn ron:ro rus:ru kin:rw san:sa srd:sc snd:sd sme:se sag:sg sin:si
    slk:sk slv:sl smo:sm sna:sn som:so sqi:sq srp:sr ssw:ss sot:st sun:su swe:sv swa:sw tam:ta tel:te tgk:tg tha:th
    tir:ti tuk:tk tgl:tl tsn:tn ton:to tur:tr tso:ts tat:tt twi:tw tah:ty uig:ug ukr:uk urd:ur uzb:uz ven:ve vie:vi
    vol:vo wln:wa wol:wo xho:xh yid:yi yor:yo zha:za zho:zh zul:zu
    arb:ar acm:ar acq:ar aeb:ar ajp:ar apc:ar ars:ar ary:ar arz:ar ayr:ay azj:az azb:az ekk:et pes:fa prs:fa fuv:ff
    knc:kr kmr:ku ckb:ku lvs:lv plt:mg khk:mn zsm:ms npi:ne gaz:om ory:or pbt:ps quy:qu als:sq swh:sw uzn:uz
    ydd:yi""".split()
)


def splitter_language(code: str | None) -> str:
    """sentencex's language code for a model's or a user's: NLLB's deu_Latn, M2M-100's de, mBART-50's de_DE and
    ISO 639-3's deu all give "de"; None or "" gives "en". A code sentencex has no rules for is passed on as it is:
    sentencex follows its fallbacks (MediaWiki's: bar -> de, de-at -> de) and else applies its English rules."""
    if not code:
        return "en"
    base = code.replace("-", "_").split("_")[0].lower()
    return _ISO_639_1.get(base, base)  # NLLB's als_Latn is Tosk Albanian (sq), not sentencex's Alemannic


def _sentencex():
    """sentencex's `segment`, or a UsageError naming the extra that installs it."""
    try:
        from sentencex import segment
    except ImportError:
        raise UsageError(f"splitting a document into sentences needs sentencex: {EXTRA}") from None
    return segment


def model_fits(tokenizer, config: TransformerConfig) -> Callable[[str], bool]:
    """Whether a sentence fits the model: its tokens (a language code's included) and EOS within max_len."""
    return lambda sentence: len(tokenizer.encode(sentence)) + 1 <= config.max_len


# =============================================================================================================
# Sentences and separators
# =============================================================================================================


class Piece(NamedTuple):
    """A piece of a document: a sentence (or a part of one, `cut`: a cut was made just before it) or the
    whitespace between two sentences (`sentence` False, kept as it is)."""

    text: str
    sentence: bool
    cut: bool = False


class _Pieces(list):
    """Pieces that alternate: the whitespace added between two sentences is one separator (joined once, when the
    next sentence or `done` comes), an empty one where nothing separates them (Chinese, or a cut inside a word)."""

    def __init__(self) -> None:
        super().__init__()
        self.gap: list[str] = []

    def add(self, text: str, sentence: bool, cut: bool = False) -> None:
        if not sentence:
            self.gap.append(text)
            return
        gap = "".join(self.gap)
        if gap or self:  # "" only between two sentences
            self.append(Piece(gap, False))
        self.gap = []
        self.append(Piece(text, True, cut))

    def done(self) -> list[Piece]:
        if "".join(self.gap):
            self.append(Piece("".join(self.gap), False))
        self.gap = []
        return self


class Segmenter:
    """Cuts text into sentences and the separators around them, for `language` (a model's code or sentencex's:
    `splitter_language`). `fits(sentence)` says whether a sentence fits the model (`model_fits`); one that does not
    is cut into parts that do. Without `fits`, sentences are left whole."""

    def __init__(self, language: str | None = "en", fits: Callable[[str], bool] | None = None) -> None:
        self.language = splitter_language(language)
        self.fits = fits
        self._segment = _sentencex()

    def with_fits(self, fits: Callable[[str], bool] | None) -> Segmenter:
        """The same segmenter with another `fits`."""
        made = copy.copy(self)
        made.fits = fits
        return made

    def pieces(self, text: str) -> list[tuple[str, bool]]:
        """`text` as (piece, is_sentence) pairs that alternate, whose texts join to `text` exactly. A separator is
        whitespace (line breaks and blank lines included; "" between two sentences nothing separates); a sentence
        has none around it, and no line break in it."""
        return [(piece.text, piece.sentence) for piece in self.split(text)]

    def split(self, text: str) -> list[Piece]:
        """`pieces`, as Piece tuples: a sentence's part that follows a cut says so."""
        out = _Pieces()
        at = 0
        for found in LINE_BREAK.finditer(text):
            self._add_line(text[at : found.start()], out)
            out.add(found.group(), False)
            at = found.end()
        self._add_line(text[at:], out)
        return out.done()

    def sentences(self, line: str) -> list[tuple[int, int]]:
        """(start, end) of each sentence of one line (no line break in it), the whitespace around it left out."""
        if line.isspace() or not line:
            return []
        # sentencex 1.0.32 panics on a capital, a non-ASCII space and a period ("J\u00a0."): it sees ASCII spaces.
        seen = line.translate(_ASCII_SPACES)
        try:
            found = self._segment(self.language, seen)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # any other panic of sentencex's Rust (pyo3's PanicException is a BaseException)
            found = [seen]
        if "".join(found) != seen:  # never seen; the line is then one sentence rather than text lost
            found = [seen]
        spans, at = [], 0
        for segment in found:
            start, end = at + len(segment) - len(segment.lstrip()), at + len(segment.rstrip())
            if end > start:
                spans.append((start, end))
            at += len(segment)
        return spans

    def _add_line(self, line: str, out: _Pieces, spans: list[tuple[int, int]] | None = None) -> None:
        """The separators and sentences of one line (`spans`: its sentences, default `sentences(line)`)."""
        at = 0
        for start, end in self.sentences(line) if spans is None else spans:
            out.add(line[at:start], False)
            self._add_sentence(line[start:end], out)
            at = end
        out.add(line[at:], False)

    def _add_sentence(self, sentence: str, out: _Pieces) -> None:
        """A sentence, or where it does not fit, its parts with the whitespace between them."""
        if self.fits is None or self.fits(sentence):
            out.add(sentence, True)
            return
        at = 0
        while at < len(sentence):
            part = sentence[at : at + self._next_cut(sentence[at:])].rstrip()
            out.add(part, True, at > 0)
            after = _SPACES.match(sentence, at + len(part)).end()
            out.add(sentence[at + len(part) : after], False)
            at = after

    def _next_cut(self, rest: str) -> int:
        """Where the first part of `rest` ends: all of it if it fits; else after the last clause mark that leaves a
        part that fits, unless a space leaves one twice as long; else at the last such space; else after the most
        characters that fit."""
        window = 64  # doubled while it fits: the cost grows with the part, not with the sentence
        while window < len(rest) and self.fits(rest[:window]):
            window *= 2
        if window >= len(rest) and self.fits(rest):
            return len(rest)
        head = rest[: window + 1]
        clause = self._last_fitting(rest, [m.end() for m in _CLAUSE_END.finditer(head)])
        space = self._last_fitting(rest, [m.start() for m in _WORD_END.finditer(head)])
        if clause and 2 * clause >= space:
            return clause
        if space:
            return space
        end = self._last_fitting(rest, range(1, min(window, len(rest)))) or 1
        while end > 1 and (unicodedata.combining(rest[end]) or rest[end] in _JOINERS):
            end -= 1  # a combining accent stays with its letter
        return end

    def _last_fitting(self, rest: str, ends) -> int:
        """The largest of the sorted `ends` whose prefix of `rest` fits (a binary search); 0 if none does."""
        low, high, best = 0, len(ends) - 1, 0
        while low <= high:
            middle = (low + high) // 2
            if 0 < ends[middle] < len(rest) and self.fits(rest[: ends[middle]]):
                best, low = ends[middle], middle + 1
            else:
                high = middle - 1
        return best

    def split_long_line(self, line: str, limit: int) -> tuple[list[Piece], str, bool]:
        """The part of a line without its end (`line`, longer than `limit` characters) that can be translated now:
        (its pieces, the rest, whether the rest continues a sentence that was cut). That part is every sentence but
        the last, which may go on; with a single sentence, the line up to a clause mark or space in the second half
        of the first `limit` characters, else those characters."""
        spans = self.sentences(line)
        out = _Pieces()
        if not spans:  # all whitespace
            return [Piece(line, False)], "", False
        if len(spans) > 1:
            done = spans[-1][0]
            self._add_line(line[:done], out, spans[:-1])
            return out.done(), line[done:], False
        start, end = spans[0]
        if start >= len(line) - limit:  # leading whitespace first
            return [Piece(line[:start], False)], line[start:], False
        cut = _safe_cut(line, start + limit // 2, start + limit)
        sentence = line[start:cut].rstrip()
        out.add(line[:start], False)
        self._add_sentence(sentence, out)
        out.add(line[start + len(sentence) : cut], False)
        return out.done(), line[cut:], end > cut


def _safe_cut(text: str, low: int, high: int) -> int:
    """A place in text[low:high] to cut a long run without a sentence end: after the last clause mark, else before
    the last space after a word, else at `high` (a combining accent kept with its letter)."""
    window = text[low : high + 1]
    for pattern, edge in ((_CLAUSE_END, "end"), (_WORD_END, "start")):
        found = [getattr(m, edge)() for m in pattern.finditer(window)]
        found = [at for at in found if at <= high - low]
        if found:
            return low + found[-1]
    end = high
    while end > low and end < len(text) and (unicodedata.combining(text[end]) or text[end] in _JOINERS):
        end -= 1
    return end


def _line_end(text: str) -> int:
    """Where the last whole line of `text` ends (0: none); a final CR waits, as its LF may follow."""
    last = len(text) - 1 if text.endswith("\r") else len(text)
    return max(text.rfind(c, 0, last) for c in _BREAK_CHARS) + 1


def stream_pieces(
    chunks: Iterable[str], segmenter: Segmenter, *, carry_limit: int = CARRY_LIMIT, held: list[int] | None = None
) -> Iterator[Piece]:
    """The pieces of a text that comes in chunks, as `segmenter.split` cuts the whole text, each as soon as it is
    known: whole lines at once, and of a line longer than `carry_limit` characters, its finished sentences (a
    sentence that does not end within it is cut, `Segmenter.split_long_line`). Between chunks at most `carry_limit`
    characters are held; `held` (a list of one count) gets the most held."""
    carry, continued = "", False
    for chunk in chunks:
        for start in range(0, len(chunk), carry_limit):
            carry += chunk[start : start + carry_limit]
            end = _line_end(carry)
            if end:
                yield from _continuing(segmenter.split(carry[:end]), continued)
                carry, continued = carry[end:], False
            while len(carry) > carry_limit:
                pieces, carry, cut = segmenter.split_long_line(carry, carry_limit)
                yield from _continuing(pieces, continued)
                continued = cut
            if held is not None:
                held[0] = max(held[0], len(carry))
    yield from _continuing(segmenter.split(carry), continued)


def _continuing(pieces: list[Piece], continued: bool) -> Iterator[Piece]:
    """`pieces`, the first sentence marked as the part after a cut when `continued`."""
    for piece in pieces:
        if continued and piece.sentence:
            piece, continued = piece._replace(cut=True), False
        yield piece


# =============================================================================================================
# Reading
# =============================================================================================================


def read_blocks(
    source: str | os.PathLike | BinaryIO, block: int = BLOCK_BYTES, *, origin: str | None = None
) -> Iterator[str]:
    """The UTF-8 text of a file or binary stream (stdin's `sys.stdin.buffer`), `block` bytes at a time, each block
    decoded as it comes (a character split between blocks waits for its rest). A UTF-8 byte-order mark at the start is
    dropped; invalid UTF-8, NUL bytes and UTF-16 are a DataError naming the line and byte offset."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        _check_readable(path, allow_empty=True)
        try:
            with open(path, "rb") as f:
                yield from read_blocks(f, block, origin=origin or str(path))
        except OSError as e:
            raise DataError(f"{path}: cannot read: {e.strerror or e}") from e
        return
    origin = origin or getattr(source, "name", "input")
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = newlines = 0  # bytes, and line breaks, before the current block

    def fail(at: int, raw: bytes, what: str, why: str) -> DataError:
        line = newlines + raw[: max(0, at - offset)].count(b"\n") + 1  # raw: the block `at` is in, if any
        return DataError(f"{origin}, line {line}: {what} at byte offset {at}: {why}")

    while raw := source.read(block if offset else max(block, 3)):  # a byte-order mark read whole
        if offset == 0:
            if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
                raise DataError(
                    f"{origin}, line 1: starts with a UTF-16 byte-order mark: the text is UTF-16, not UTF-8; convert "
                    f"it, e.g. iconv -f UTF-16 -t UTF-8"
                )
            if raw.startswith(codecs.BOM_UTF8):
                raw, offset = raw[len(codecs.BOM_UTF8) :], len(codecs.BOM_UTF8)
        nul = raw.find(b"\0")
        if nul >= 0:
            raise fail(
                offset + nul, raw, "NUL byte", "not UTF-8 text (a binary file, or UTF-16 without a byte-order mark?)"
            )
        try:
            text = decoder.decode(raw)
        except UnicodeDecodeError as e:
            at = offset - (len(e.object) - len(raw)) + e.start  # e.object: the bytes held from before, then raw
            raise fail(at, raw, f"not valid UTF-8: byte 0x{e.object[e.start]:02x}", e.reason) from None
        newlines += raw.count(b"\n")
        offset += len(raw)
        if text:
            yield text
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
        raise fail(
            offset - len(e.object) + e.start, b"", "not valid UTF-8", "the text ends inside a character"
        ) from None


# =============================================================================================================
# Translating a document
# =============================================================================================================


@dataclasses.dataclass
class DocumentReport:
    """What `translate_document` did: sentences translated (each part of a cut one), lines and paragraphs read,
    the cuts made in sentences longer than the model takes (where the next part begins: line and character, both
    1-based, the first few), and the most characters of an unfinished line held at once."""

    origin: str = "input"
    language: str = "en"
    sentences: int = 0
    lines: int = 0
    paragraphs: int = 0
    cuts: int = 0
    cut_at: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    largest_carry: int = 0

    def describe(self) -> str:
        text = (
            f"translated {self.sentences} sentences ({self.lines} lines, {self.paragraphs} paragraphs; "
            f"sentencex, language {self.language})"
        )
        if self.cuts:
            places = ", ".join(f"{line}:{column}" for line, column in self.cut_at)
            more = ", ..." if self.cuts > len(self.cut_at) else ""
            text += f"; {self.cuts} cuts in sentences longer than the model takes, at {self.origin} line:character "
            text += places + more
        return text


class _Place:
    """Where a document's next piece begins, and the report's counts of what came before."""

    def __init__(self, report: DocumentReport) -> None:
        self.report, self.line, self.column, self.breaks = report, 1, 0, 0  # breaks: since the last sentence

    def passed(self, piece: Piece) -> None:
        report = self.report
        if piece.sentence:
            report.sentences += 1
            if report.sentences == 1 or self.breaks >= 2:  # a blank line before it
                report.paragraphs += 1
            if piece.cut:
                report.cuts += 1
                if len(report.cut_at) < MAX_REPORTED_CUTS:
                    report.cut_at.append((self.line, self.column + 1))
            self.breaks = 0
        breaks = list(LINE_BREAK.finditer(piece.text))
        if breaks:
            self.line, self.breaks = self.line + len(breaks), self.breaks + len(breaks)
            self.column = len(piece.text) - breaks[-1].end()
        else:
            self.column += len(piece.text)

    def lines(self) -> int:
        return self.line - 1 + (self.column > 0)


def translate_document(
    params,
    config: TransformerConfig,
    tokenizer,
    chunks: Iterable[str],
    write: Callable[[str], None],
    decode: DecodeConfig | None = None,
    *,
    segmenter: Segmenter | None = None,
    origin: str = "input",
    progress: bool | None = True,
    chunk_sentences: int = CHUNK_SENTENCES,
    carry_limit: int = CARRY_LIMIT,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    glossary=None,
) -> DocumentReport:
    """Translates a document that comes as `chunks` of text (`read_blocks`), sentence by sentence, and calls
    `write(text)` with the translated document, in order: each sentence replaced by its best translation (line
    breaks in it become spaces), every separator as it was. Between two sentences that nothing separated (Chinese,
    or a cut inside a word), a space is written where both translations' facing characters are not wide (CJK).

    `segmenter` (default: English) cuts the sentences; without `fits` it gets the model's (`model_fits`). Memory is
    bounded whatever the document: at most `carry_limit` characters of an unfinished line are held (a longer
    sentence is cut), and `chunk_sentences` sentences are translated together (sorted into batches of `batch_size`
    sentences or `max_tokens` token slots by `translation.translate`), then written. `progress`: a tqdm bar of
    sentences on stderr (None: when stderr is a terminal). `origin` names the input in the report's places.
    `glossary` (a `glossary.Glossary`): each sentence's translation holds the target terms of its source terms."""
    segmenter = segmenter or Segmenter("en")
    if segmenter.fits is None:
        segmenter = segmenter.with_fits(model_fits(tokenizer, config))
    report = DocumentReport(origin, segmenter.language)
    place, joined, pending, held = _Place(report), _Joined(), [], [0]
    sentences = characters = 0  # waiting in `pending`
    bar = tqdm(
        desc="translate", unit="sentence", disable=None if progress is None else not progress, dynamic_ncols=True
    )

    def flush() -> None:
        nonlocal sentences, characters
        sources = [piece.text for piece in pending if piece.sentence]
        terms = None if glossary is None else [glossary.constraints(text) for text in sources]
        found = translation.translate(params, config, tokenizer, sources, decode, batch_size=batch_size,
                                      max_tokens=max_tokens, progress=False, constraints=terms)  # fmt: skip
        write(joined(pending, iter(found)))
        bar.update(len(sources))
        pending.clear()
        sentences = characters = 0

    with bar:
        for piece in stream_pieces(chunks, segmenter, carry_limit=carry_limit, held=held):
            place.passed(piece)
            pending.append(piece)
            sentences, characters = sentences + piece.sentence, characters + len(piece.text)
            if sentences >= chunk_sentences or characters >= PENDING_CHARS:
                flush()
        flush()
    report.lines, report.largest_carry = place.lines(), held[0]
    return report


def joined(pieces: list[Piece], translations: Iterable[str]) -> str:
    """One text's pieces (`Segmenter.split`) with each sentence replaced by its translation, joined as
    `translate_document` joins them (the server's texts too)."""
    return _Joined()(pieces, iter(translations))


class _Joined:
    """Pieces with each sentence replaced by the next translation (line breaks in it made spaces), chunk after
    chunk; between two sentences that nothing separated, a space where neither facing character is wide (CJK)."""

    def __init__(self) -> None:
        self.last, self.separated = "", True  # the last character written; whether whitespace came after it

    def __call__(self, pieces: list[Piece], translations: Iterator[str]) -> str:
        out = []
        for piece in pieces:
            if not piece.sentence:
                out.append(piece.text)
                self.separated = self.separated or piece.text != ""
                continue
            text = LINE_BREAK.sub(" ", next(translations))
            if text and not self.separated and not (_wide(self.last) or _wide(text[0])):
                out.append(" ")
            if text:
                out.append(text)
                self.last, self.separated = text[-1], False
        return "".join(out)


def _wide(char: str) -> bool:
    return unicodedata.east_asian_width(char) in "WF"


class OutputText:
    """`translate_document`'s `write` into a file descriptor (stdout's): each text written whole with `os.write`
    (Python's buffered writer can report a short write to a full disk as done). A failed write is a WriteError naming
    the output and how many bytes it holds; a closed pipe (`| head`) a BrokenPipeError, for the caller to end
    quietly."""

    def __init__(self, fd: int, name: str = "stdout", errors: str = "strict") -> None:
        self.fd, self.name, self.written, self.errors = fd, name, 0, errors  # errors: of str.encode

    def __call__(self, text: str) -> None:
        left = memoryview(text.encode("utf-8", self.errors))
        try:
            while left:
                done = os.write(self.fd, left)
                left, self.written = left[done:], self.written + done
        except BrokenPipeError:
            raise
        except OSError as e:
            raise WriteError(
                f"cannot write to {self.name}: {e.strerror or e}; it holds the first {self.written} bytes of the "
                f"translated document"
            ) from None
