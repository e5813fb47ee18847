"""Reading a parallel corpus: line-aligned files (or source<TAB>target lines) into a `Corpus` of string pairs, each
with the 1-based line it came from, so that every later error can point at the line at fault. Bad input (invalid
UTF-8, NUL bytes, a UTF-16 file, a missing side) is a DataError naming the file and line.

A corpus of many language pairs (for a multilingual model) is a TSV with two language columns first,
`src_lang<TAB>tgt_lang<TAB>source<TAB>target`: each pair keeps its codes (`Corpus.languages`), and whoever encodes
it marks each sentence with its own code (`batching.encode_sides`)."""

from __future__ import annotations

import codecs
import collections
import dataclasses
import io
import itertools
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from jax_transformer.errors import DataError

# How many line numbers of skipped pairs a Corpus / EncodedCorpus keeps for its report.
MAX_REPORTED_LINES = 10
_ON_EMPTY = ("skip", "error")


@dataclasses.dataclass
class Corpus:
    """Sentence pairs read from disk (or built in memory), each with the line it came from.

    `line_numbers[i]` is the 1-based line of pair i in the original file(s); skipped lines leave gaps.
    `origin` names the file(s) in messages. Empty lines that were skipped are counted in `skipped_empty`, and
    the first few of their line numbers are kept in `skipped_empty_lines` so a log can show where they were.
    `stripped_boms` counts the files that began with a UTF-8 byte-order mark and `crlf_lines` the lines that
    ended in CRLF: both are removed while reading (see `read_lines`) and reported by `describe`.
    `languages[i]`: pair i's (source, target) language codes, for a TSV read with language columns; else None.
    """

    sources: list[str]
    targets: list[str]
    line_numbers: list[int]
    origin: str
    skipped_empty: int = 0
    skipped_empty_lines: list[int] = dataclasses.field(default_factory=list)
    stripped_boms: int = 0
    crlf_lines: int = 0
    languages: list[tuple[str, str]] | None = None

    def __post_init__(self) -> None:
        if not len(self.sources) == len(self.targets) == len(self.line_numbers):
            raise ValueError(
                f"{self.origin}: Corpus needs as many sources ({len(self.sources)}) as targets "
                f"({len(self.targets)}) and line numbers ({len(self.line_numbers)})"
            )
        if self.languages is not None and len(self.languages) != len(self.sources):
            raise ValueError(f"{self.origin}: {len(self.languages)} language pairs for {len(self.sources)} pairs")

    def __len__(self) -> int:
        return len(self.sources)

    def describe(self) -> str:
        """One line for a log: how many pairs were kept, how many empty lines skipped, and where; what the
        reader removed (byte-order marks, CRLF line ends)."""
        return describe_pairs(
            self.origin,
            len(self),
            self.skipped_empty,
            self.skipped_empty_lines,
            self.stripped_boms,
            self.crlf_lines,
            None if self.languages is None else collections.Counter(map(pair_name, self.languages)),
        )


def pair_name(languages: Sequence[str]) -> str:
    """A language pair in logs and metric names: "deu_Latn-eng_Latn"."""
    return "-".join(languages)


def describe_pairs(
    origin: str,
    pairs: int,
    skipped_empty: int,
    skipped_empty_lines: Sequence[int],
    boms: int,
    crlf_lines: int,
    language_pairs: Mapping[str, int] | None = None,
) -> str:
    """Corpus.describe's line from its counts (also for a corpus encoded on disk, `token_arrays`)."""
    text = f"{origin}: {pairs} pairs"
    if language_pairs is not None:
        counts = ", ".join(f"{name} {n}" for name, n in sorted(language_pairs.items()))
        text += f" in {len(language_pairs)} language pair{'s' * (len(language_pairs) != 1)} ({counts})"
    if skipped_empty:
        text += f", skipped {skipped_empty} with an empty side{lines_hint(skipped_empty_lines)}"
    if boms:
        text += f", removed a UTF-8 byte-order mark ({boms} file{'s' * (boms > 1)})"
    if crlf_lines:
        text += f", removed CR from {crlf_lines} CRLF line end{'s' * (crlf_lines > 1)}"
    return text


def lines_hint(lines: Sequence[int]) -> str:
    return f" (lines {', '.join(map(str, lines))}{', ...' if len(lines) == MAX_REPORTED_LINES else ''})"


def location(origin: str | os.PathLike, line: int) -> str:
    """The location prefix of every error message about one line."""
    return f"{origin}, line {line}"


def _check_readable(path: Path, *, allow_empty: bool = False) -> None:
    # Checked up front so that a missing second file is reported before any line of the first is read.
    if not path.exists():
        raise DataError(f"{path}: file not found")
    if path.is_dir():
        raise DataError(f"{path}: is a directory, not a text file")
    if not path.is_file():
        raise DataError(f"{path}: not a regular file")
    if not allow_empty and path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty")


@dataclasses.dataclass
class ReadStats:
    """What `read_lines` removed while reading: a UTF-8 byte-order mark (0 or 1) and CRs of CRLF line ends."""

    stripped_boms: int = 0
    crlf_lines: int = 0


_UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


def read_lines(
    source: str | os.PathLike | io.BufferedIOBase, *, origin: str | None = None, stats: ReadStats | None = None
) -> Iterator[tuple[int, str]]:
    """Yields (1-based line number, text) for each line of UTF-8 text, a file path or a binary stream (stdin's
    `sys.stdin.buffer`), one line at a time (memory: one line), with only the line ending removed.

    Lines are split on b"\\n" only: str.splitlines() would also split on characters such as U+2028 that can occur
    inside a sentence, and break the line alignment of a parallel corpus. Each line is decoded on its own, so
    bad input is reported with its line and byte offset:
    * a UTF-8 byte-order mark at the start (Windows editors write one) and the CR of CRLF line ends are removed
      and counted in `stats`;
    * invalid UTF-8 and NUL bytes (a binary or UTF-16 file) are a DataError naming the line and byte offset;
      a UTF-16 byte-order mark gets its own message.
    A line is read whole, however long (a line of megabytes is read, then counted as too long by
    `encode_corpus`, or refused or truncated by `translate`).
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        _check_readable(path, allow_empty=True)
        try:
            with open(path, "rb") as f:
                yield from read_lines(f, origin=origin or str(path), stats=stats)
        except OSError as e:  # e.g. permission denied; a missing file was caught by _check_readable
            raise DataError(f"{path}: cannot read: {e.strerror or e}") from e
        return
    origin = origin or getattr(source, "name", "input")
    stats = stats if stats is not None else ReadStats()
    offset = 0  # byte offset of the current line's start in the file
    for number, raw in enumerate(source, start=1):
        start, offset = offset, offset + len(raw)
        if raw.endswith(b"\r\n"):
            raw = raw[:-2]
            stats.crlf_lines += 1
        elif raw.endswith(b"\n"):
            raw = raw[:-1]
        if number == 1:
            if raw.startswith(codecs.BOM_UTF8):
                # Editors on Windows often start UTF-8 files with a byte-order mark; it is not text.
                raw, start = raw[len(codecs.BOM_UTF8) :], start + len(codecs.BOM_UTF8)
                stats.stripped_boms += 1
            elif raw.startswith(_UTF16_BOMS):
                raise DataError(
                    f"{location(origin, 1)}: starts with a UTF-16 byte-order mark: the text is UTF-16, not UTF-8; "
                    f"convert it, e.g. iconv -f UTF-16 -t UTF-8"
                )
        nul = raw.find(b"\0")
        if nul >= 0:
            raise DataError(
                f"{location(origin, number)}: NUL byte at byte offset {start + nul} (byte {nul + 1} of the line): "
                f"not UTF-8 text (a binary file, or UTF-16 without a byte-order mark?)"
            )
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"{location(origin, number)}: not valid UTF-8: byte 0x{raw[e.start]:02x} at byte offset "
                f"{start + e.start} of the file (byte {e.start + 1} of the line): {e.reason}"
            ) from None
        yield number, text


def count_lines(path: str | os.PathLike, block: int = 1 << 20) -> int:
    """The number of lines `read_lines` yields for a file (a last line without "\\n" counts), read in blocks:
    for a progress bar's total, without holding the file."""
    _check_readable(Path(path), allow_empty=True)
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(block):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return lines + (last != b"\n")


class PairReader:
    """The pairs of one corpus (a TSV file, or two line-aligned files), read one at a time: what `read_tsv` and
    `read_parallel` collect into a Corpus, and what `token_arrays` encodes onto disk without holding the text.

    Iterating yields (line, source, target) for every kept pair; `rows()` yields (line, source, target, languages),
    languages being the pair's (source, target) codes when the TSV has language columns
    (`src_lang<TAB>tgt_lang<TAB>source<TAB>target`), else None. Pairs with an empty side are skipped and counted
    (`skipped_empty`, the first few of their lines in `skipped_empty_lines`) or are a DataError (on_empty="error").
    `stats` counts what the reader removed; `lines` is the last line read; `language_pairs` counts the kept pairs
    of each language pair. `describe` is Corpus.describe's line.
    """

    def __init__(
        self, paths: Sequence[str | os.PathLike], *, on_empty: str = "skip", language_columns: bool = False
    ) -> None:
        if on_empty not in _ON_EMPTY:
            raise ValueError(f"on_empty must be one of {_ON_EMPTY}, got {on_empty!r}")
        if len(paths) not in (1, 2):
            raise ValueError(f"PairReader reads a TSV file or a source and a target file, got {len(paths)} paths")
        if language_columns and len(paths) != 1:
            raise DataError("language columns are read from a TSV file (--tsv), not from a source and a target file")
        self.paths = [Path(p) for p in paths]
        for path in self.paths:
            _check_readable(path)
        self.on_empty = on_empty
        self.language_columns = language_columns
        self.origin = " + ".join(map(str, self.paths))
        self.stats = ReadStats()  # shared by the readers of every file of this corpus
        self.pairs = self.skipped_empty = self.lines = 0
        self.skipped_empty_lines: list[int] = []
        self.language_pairs: collections.Counter[str] | None = collections.Counter() if language_columns else None

    def __iter__(self) -> Iterator[tuple[int, str, str]]:
        return ((line, source, target) for line, source, target, _ in self.rows())

    def rows(self) -> Iterator[tuple[int, str, str, tuple[str, str] | None]]:
        candidates = self._tsv() if len(self.paths) == 1 else self._parallel()
        for line, source, target, languages, empty_error in candidates:
            self.lines = line
            if source.strip() and target.strip():
                self.pairs += 1
                if languages is not None:
                    self.language_pairs[pair_name(languages)] += 1
                yield line, source, target, languages
            elif self.on_empty == "error":
                raise DataError(empty_error + ' (pass on_empty="skip" to skip such pairs)')
            else:
                self.skipped_empty += 1
                if len(self.skipped_empty_lines) < MAX_REPORTED_LINES:
                    self.skipped_empty_lines.append(line)
        if not self.pairs:  # nothing could be trained or evaluated on
            raise DataError(f"{self.origin}: no sentence pairs: all {self.lines} lines have an empty side")

    def _tsv(self) -> Iterator[tuple[int, str, str, tuple[str, str] | None, str]]:
        path = self.paths[0]
        for line, text in read_lines(path, stats=self.stats):
            tabs = text.count("\t")
            if not self.language_columns:
                if tabs != 1:
                    raise DataError(
                        f"{location(path, line)}: expected exactly one tab between source and target, found {tabs}"
                    )
                source, target = text.split("\t")
                side = "source (left of the tab)" if not source.strip() else "target (right of the tab)"
                yield line, source, target, None, f"{location(path, line)}: empty {side}"
                continue
            if tabs != 3:
                raise DataError(
                    f"{location(path, line)}: expected src_lang<TAB>tgt_lang<TAB>source<TAB>target (three tabs, "
                    f"--language-columns), found {tabs}"
                )
            src_lang, tgt_lang, source, target = text.split("\t")
            for column, code in (("first", src_lang), ("second", tgt_lang)):
                if not code or code != code.strip():
                    raise DataError(
                        f"{location(path, line)}: the {column} column ({'source' if column == 'first' else 'target'} "
                        f"language) is {code!r}, not a language code"
                    )
            side = "source (third column)" if not source.strip() else "target (fourth column)"
            yield line, source, target, (src_lang, tgt_lang), f"{location(path, line)}: empty {side}"

    def _parallel(self) -> Iterator[tuple[int, str, str, None, str]]:
        src, tgt = self.paths
        for src_item, tgt_item in itertools.zip_longest(
            read_lines(src, stats=self.stats), read_lines(tgt, stats=self.stats)
        ):
            if src_item is None or tgt_item is None:
                n_src, n_tgt = count_lines(src), count_lines(tgt)
                longer, shorter = (src, tgt) if n_src > n_tgt else (tgt, src)
                missing = "translation" if longer == src else "source sentence"  # what the shorter file lacks
                raise DataError(
                    f"{src} has {n_src} lines but {tgt} has {n_tgt}: {shorter} ends after line "
                    f"{min(n_src, n_tgt)}, so line {min(n_src, n_tgt) + 1} of {longer} has no {missing} in {shorter}; "
                    f"the files must be line-aligned"
                )
            (line, source), (_, target) = src_item, tgt_item
            if not source.strip():
                message = f"{location(src, line)}: empty source line" + ("" if target.strip() else f" (and {tgt} too)")
            else:
                message = f"{location(tgt, line)}: empty target line"
            yield line, source, target, None, message

    def describe(self) -> str:
        """Corpus.describe's line, for the pairs read so far."""
        return describe_pairs(
            self.origin,
            self.pairs,
            self.skipped_empty,
            self.skipped_empty_lines,
            self.stats.stripped_boms,
            self.stats.crlf_lines,
            self.language_pairs,
        )

    def read(self) -> Corpus:
        """Every pair, in memory."""
        corpus = Corpus([], [], [], self.origin, languages=[] if self.language_columns else None)
        for line, source, target, languages in self.rows():
            corpus.sources.append(source)
            corpus.targets.append(target)
            corpus.line_numbers.append(line)
            if languages is not None:
                corpus.languages.append(languages)
        corpus.skipped_empty, corpus.skipped_empty_lines = self.skipped_empty, self.skipped_empty_lines
        corpus.stripped_boms, corpus.crlf_lines = self.stats.stripped_boms, self.stats.crlf_lines
        return corpus


def read_parallel(src_path: str | os.PathLike, tgt_path: str | os.PathLike, *, on_empty: str = "skip") -> Corpus:
    """Reads two line-aligned UTF-8 files: line i of `src_path` translates to line i of `tgt_path`.

    Only the line ending ("\\n" or "\\r\\n") is removed; other whitespace is kept (see `read_lines` for BOMs,
    NUL bytes and invalid UTF-8). A pair with a side that is empty (after strip()) is skipped and counted
    (on_empty="skip") or is a DataError (on_empty="error"). Files with different line counts are a DataError
    naming both counts: the alignment is broken somewhere, and guessing where would train on mistranslations.
    An empty file, or files without a single complete pair, are a DataError.
    """
    return PairReader([src_path, tgt_path], on_empty=on_empty).read()


def read_tsv(path: str | os.PathLike, *, on_empty: str = "skip", language_columns: bool = False) -> Corpus:
    """Reads `source<TAB>target` lines from one UTF-8 file; each line must hold exactly one tab (with
    `language_columns`, `src_lang<TAB>tgt_lang<TAB>source<TAB>target` lines: three tabs).

    Empty sides, empty files and bad bytes are handled as in `read_parallel`.
    """
    return PairReader([path], on_empty=on_empty, language_columns=language_columns).read()


class Fingerprint:
    """A hash of the pairs' text, added pair by pair: a resumed run checks that it sees the same training data."""

    def __init__(self) -> None:
        import hashlib

        self._digest = hashlib.sha256()

    def add(self, source: str, target: str, languages: Sequence[str] | None = None) -> None:
        codes = "".join(code + "\t" for code in languages or ()).encode("utf-8")  # a pair without codes: as before
        self._digest.update(codes + source.encode("utf-8") + b"\t" + target.encode("utf-8") + b"\n")

    def hexdigest(self) -> str:
        return self._digest.hexdigest()[:16]


def corpus_fingerprint(corpus: Corpus) -> str:
    """The `Fingerprint` of a Corpus in memory."""
    fingerprint = Fingerprint()
    for i, (source, target) in enumerate(zip(corpus.sources, corpus.targets)):
        fingerprint.add(source, target, None if corpus.languages is None else corpus.languages[i])
    return fingerprint.hexdigest()
