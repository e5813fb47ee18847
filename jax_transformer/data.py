"""The data pipeline: parallel text -> subword ids -> fixed-shape, padded numpy batches.

Read top to bottom, this module follows the data:

1. `read_parallel` / `read_tsv` read a line-aligned corpus into a `Corpus` (strings plus the 1-based line each
   pair came from, so every later error can point at the line at fault).
2. `Tokenizer` wraps one joint SentencePiece model for both languages. The paper shares one subword vocabulary
   between source and target (section 5.1), which is what lets the model share its embedding tables.
3. `encode_corpus` turns strings into id arrays and applies `max_len`; a pair that does not fit is skipped and
   counted, or is an error -- never silently truncated.
4. `BatchStream` (training) and `eval_batches` (evaluation) cut the pairs into batches of about `max_tokens`
   token slots, in one of two ways (`DataConfig.batching`):
   - "packed" (the default, as in Flax's WMT example): several pairs one after the other in each row, every
     batch of one shape (rows, L), so a jitted step compiles once per run; segment ids and positions tell the
     model where each pair starts (`PACKING_KEYS`), so every pair gets exactly the logits it gets alone.
   - "buckets" (like fairseq and tensor2tensor): one pair per row, pairs of similar length together; every
     batch of one length bucket has the same shape, so a jitted step compiles once per bucket.
5. `DataConfig`, `load_corpus`, `corpus_fingerprint`: the data settings of a training run (which files, the
   tokenizer, the batch size), stored in its checkpoints so that a resume re-reads the same corpus.

Sequence conventions, shared with the models (ids from `TransformerConfig`: pad 0, bos 1, eos 2):

* encoder input   `src`     = source tokens + [EOS]    (n source tokens occupy n + 1 positions)
* decoder input   `tgt_in`  = [BOS] + target tokens    (n target tokens occupy n + 1 positions)
* decoder target  `tgt_out` = target tokens + [EOS]    (`tgt_in` shifted left by one)

All three are padded with PAD on the right. In a batch, `src` and `tgt_*` are padded to the same length L (the
bucket's, or the packed rows'): that costs a little padding when the two sides differ in length, but gives one
length per batch and so the fewest distinct shapes. Nothing here imports jax or torch: batches are plain
`np.int32` arrays.
"""

from __future__ import annotations

import codecs
import dataclasses
import io
import itertools
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm

from jax_transformer.config import setting, settings_from_dict

# The special ids. They equal TransformerConfig's defaults; the tokenizer is trained to use exactly these.
PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3

# How many line numbers of skipped pairs a Corpus / EncodedCorpus keeps for its report.
MAX_REPORTED_LINES = 10

_ON_EMPTY = ("skip", "error")
_ON_TOO_LONG = ("skip", "error")
BATCHINGS = ("packed", "buckets")  # see the module docstring, point 4

# What a packed batch carries besides src, tgt_in and tgt_out (the model's keyword arguments of the same names;
# jax_transformer.training.PACKING_KEYS): segment ids 1, 2, ... per pair along a row (0 = padding) and each
# token's position within its own pair.
PACKING_KEYS = ("src_segments", "tgt_segments", "src_positions", "tgt_positions")


class DataError(ValueError):
    """The data cannot be used as given. The message names the file (or corpus) and the 1-based line at fault."""


# =============================================================================================================
# 1. Reading a parallel corpus
# =============================================================================================================


@dataclasses.dataclass
class Corpus:
    """Sentence pairs read from disk (or built in memory), each with the line it came from.

    `line_numbers[i]` is the 1-based line of pair i in the original file(s); skipped lines leave gaps.
    `origin` names the file(s) in messages. Empty lines that were skipped are counted in `skipped_empty`, and
    the first few of their line numbers are kept in `skipped_empty_lines` so a log can show where they were.
    `stripped_boms` counts the files that began with a UTF-8 byte-order mark and `crlf_lines` the lines that
    ended in CRLF: both are removed while reading (see `read_lines`) and reported by `describe`.
    """

    sources: list[str]
    targets: list[str]
    line_numbers: list[int]
    origin: str
    skipped_empty: int = 0
    skipped_empty_lines: list[int] = dataclasses.field(default_factory=list)
    stripped_boms: int = 0
    crlf_lines: int = 0

    def __post_init__(self) -> None:
        if not len(self.sources) == len(self.targets) == len(self.line_numbers):
            raise ValueError(
                f"{self.origin}: Corpus needs as many sources ({len(self.sources)}) as targets "
                f"({len(self.targets)}) and line numbers ({len(self.line_numbers)})"
            )

    def __len__(self) -> int:
        return len(self.sources)

    def describe(self) -> str:
        """One line for a log: how many pairs were kept, how many empty lines skipped, and where; what the
        reader removed (byte-order marks, CRLF line ends)."""
        text = f"{self.origin}: {len(self)} pairs"
        if self.skipped_empty:
            text += f", skipped {self.skipped_empty} with an empty side{_lines_hint(self.skipped_empty_lines)}"
        if self.stripped_boms:
            text += f", removed a UTF-8 byte-order mark ({self.stripped_boms} file{'s' * (self.stripped_boms > 1)})"
        if self.crlf_lines:
            text += f", removed CR from {self.crlf_lines} CRLF line end{'s' * (self.crlf_lines > 1)}"
        return text


def _lines_hint(lines: Sequence[int]) -> str:
    return f" (lines {', '.join(map(str, lines))}{', ...' if len(lines) == MAX_REPORTED_LINES else ''})"


def _where(origin: str | os.PathLike, line: int) -> str:
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
                    f"{_where(origin, 1)}: starts with a UTF-16 byte-order mark: the text is UTF-16, not UTF-8; "
                    f"convert it, e.g. iconv -f UTF-16 -t UTF-8"
                )
        nul = raw.find(b"\0")
        if nul >= 0:
            raise DataError(
                f"{_where(origin, number)}: NUL byte at byte offset {start + nul} (byte {nul + 1} of the line): "
                f"not UTF-8 text (a binary file, or UTF-16 without a byte-order mark?)"
            )
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"{_where(origin, number)}: not valid UTF-8: byte 0x{raw[e.start]:02x} at byte offset "
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


class _CorpusBuilder:
    """Collects pairs, applying the empty-line policy, for both readers."""

    def __init__(self, origin: str, on_empty: str) -> None:
        if on_empty not in _ON_EMPTY:
            raise ValueError(f"on_empty must be one of {_ON_EMPTY}, got {on_empty!r}")
        self.corpus = Corpus([], [], [], origin)
        self.on_empty = on_empty
        self.stats = ReadStats()  # shared by the readers of every file of this corpus

    def add(self, line: int, source: str, target: str, empty_error: str) -> None:
        """Adds one pair; `empty_error` is the message to raise if a side is empty and on_empty is "error"."""
        if source.strip() and target.strip():
            self.corpus.sources.append(source)
            self.corpus.targets.append(target)
            self.corpus.line_numbers.append(line)
        elif self.on_empty == "error":
            raise DataError(empty_error + ' (pass on_empty="skip" to skip such pairs)')
        else:
            self.corpus.skipped_empty += 1
            if len(self.corpus.skipped_empty_lines) < MAX_REPORTED_LINES:
                self.corpus.skipped_empty_lines.append(line)

    def finish(self, lines: int) -> Corpus:
        """The corpus; a DataError if no pair is left (nothing could be trained or evaluated on)."""
        corpus = self.corpus
        corpus.stripped_boms, corpus.crlf_lines = self.stats.stripped_boms, self.stats.crlf_lines
        if not len(corpus):
            raise DataError(f"{corpus.origin}: no sentence pairs: all {lines} lines have an empty side")
        return corpus


def read_parallel(src_path: str | os.PathLike, tgt_path: str | os.PathLike, *, on_empty: str = "skip") -> Corpus:
    """Reads two line-aligned UTF-8 files: line i of `src_path` translates to line i of `tgt_path`.

    Only the line ending ("\\n" or "\\r\\n") is removed; other whitespace is kept (see `read_lines` for BOMs,
    NUL bytes and invalid UTF-8). A pair with a side that is empty (after strip()) is skipped and counted
    (on_empty="skip") or is a DataError (on_empty="error"). Files with different line counts are a DataError
    naming both counts: the alignment is broken somewhere, and guessing where would train on mistranslations.
    An empty file, or files without a single complete pair, are a DataError.
    """
    src, tgt = Path(src_path), Path(tgt_path)
    _check_readable(src)
    _check_readable(tgt)
    builder = _CorpusBuilder(f"{src} + {tgt}", on_empty)
    line = 0
    for src_item, tgt_item in itertools.zip_longest(
        read_lines(src, stats=builder.stats), read_lines(tgt, stats=builder.stats)
    ):
        if src_item is None or tgt_item is None:
            n_src, n_tgt = count_lines(src), count_lines(tgt)
            longer, shorter = (src, tgt) if n_src > n_tgt else (tgt, src)
            raise DataError(
                f"{src} has {n_src} lines but {tgt} has {n_tgt}: {shorter} ends after line {min(n_src, n_tgt)}, "
                f"so line {min(n_src, n_tgt) + 1} of {longer} has no translation; the files must be line-aligned"
            )
        (line, source), (_, target) = src_item, tgt_item
        if not source.strip():
            message = f"{_where(src, line)}: empty source line" + ("" if target.strip() else f" (and {tgt} too)")
        else:
            message = f"{_where(tgt, line)}: empty target line"
        builder.add(line, source, target, message)
    return builder.finish(line)


def read_tsv(path: str | os.PathLike, *, on_empty: str = "skip") -> Corpus:
    """Reads `source<TAB>target` lines from one UTF-8 file; each line must hold exactly one tab.

    Empty sides, empty files and bad bytes are handled as in `read_parallel`.
    """
    path = Path(path)
    _check_readable(path)
    builder = _CorpusBuilder(str(path), on_empty)
    line = 0
    for line, text in read_lines(path, stats=builder.stats):
        tabs = text.count("\t")
        if tabs != 1:
            raise DataError(f"{_where(path, line)}: expected exactly one tab between source and target, found {tabs}")
        source, target = text.split("\t")
        side = "source (left of the tab)" if not source.strip() else "target (right of the tab)"
        builder.add(line, source, target, f"{_where(path, line)}: empty {side}")
    return builder.finish(line)


# =============================================================================================================
# 2. Tokenizer: one joint SentencePiece model
# =============================================================================================================

# Training options that the rest of the project relies on; callers may not override them.
_FIXED_TRAINER_OPTIONS = dict(
    pad_id=PAD_ID,
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    unk_id=UNK_ID,
    # Small corpora may not support the requested vocabulary; take what they support instead of failing.
    # The real size is Tokenizer.vocab_size, which the trainer copies into the model config.
    hard_vocab_limit=False,
    # One thread makes training deterministic: the same texts give byte-identical models.
    num_threads=1,
    minloglevel=2,  # errors only: SentencePiece otherwise logs hundreds of lines to stderr
)


class Tokenizer:
    """Subword tokenizer for both languages, with ids pad=0, bos=1, eos=2, unk=3.

    Build one with `Tokenizer.train`, `Tokenizer.from_bytes` (the serialized model, as stored in checkpoints)
    or `Tokenizer.load` (a SentencePiece `.model` file).
    """

    def __init__(self, model_bytes: bytes, *, source: str = "tokenizer model bytes") -> None:
        """Loads a serialized SentencePiece model; `source` names it in error messages."""
        processor = spm.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(model_bytes)
        except (RuntimeError, TypeError) as e:
            raise DataError(f"{source}: not a SentencePiece model ({len(model_bytes)} bytes): {e}") from None
        ids = (processor.pad_id(), processor.bos_id(), processor.eos_id(), processor.unk_id())
        if ids != (PAD_ID, BOS_ID, EOS_ID, UNK_ID):
            raise DataError(
                f"{source}: the model's pad/bos/eos/unk ids are {ids}, this project needs "
                f"{(PAD_ID, BOS_ID, EOS_ID, UNK_ID)}; train it with Tokenizer.train"
            )
        self._processor = processor
        self._bytes = bytes(model_bytes)

    # --- building ----------------------------------------------------------------------------------------------
    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        *,
        model_type: str = "unigram",
        character_coverage: float = 1.0,
        **sentencepiece_options,
    ) -> Tokenizer:
        """Trains a model in memory on `texts` (pass source and target sentences together: one joint vocab).

        `vocab_size` is an upper bound: a small corpus may yield fewer pieces (see `vocab_size`). model_type is
        "unigram" (SentencePiece's default) or "bpe" (the paper's byte-pair encoding). character_coverage=1.0
        keeps every character seen; 0.9995 is usual for languages with large alphabets. Other SentencePiece
        trainer options pass through, e.g. seed_sentencepiece_size, or input_sentence_size=1_000_000 with
        shuffle_input_sentence=True to train on a sample of a large corpus.
        """
        if isinstance(texts, str):  # iterating a str would train on its characters, one "sentence" each
            raise TypeError("Tokenizer.train takes an iterable of sentences, not one str")
        clash = sorted(set(sentencepiece_options) & set(_FIXED_TRAINER_OPTIONS))
        if clash:
            raise ValueError(f"Tokenizer.train: options {clash} are fixed by this project and cannot be changed")
        if model_type not in ("unigram", "bpe"):
            raise ValueError(f"Tokenizer.train: model_type must be 'unigram' or 'bpe', got {model_type!r}")
        count = 0

        def sentences() -> Iterator[str]:
            nonlocal count
            for text in texts:
                count += 1
                yield text

        writer = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=sentences(),
                model_writer=writer,
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=character_coverage,
                **_FIXED_TRAINER_OPTIONS,
                **sentencepiece_options,
            )
        except RuntimeError as e:  # a DataError (a ValueError): the command line reports it without a traceback
            raise DataError(
                f"Tokenizer.train: SentencePiece failed on {count} texts "
                f"(vocab_size={vocab_size}, model_type={model_type!r}): {e}"
            ) from None
        return cls(writer.getvalue(), source="freshly trained tokenizer")

    @classmethod
    def from_bytes(cls, model_bytes: bytes) -> Tokenizer:
        """The inverse of `to_bytes`."""
        return cls(model_bytes)

    def to_bytes(self) -> bytes:
        """The serialized model (a SentencePiece ModelProto); store it with a checkpoint."""
        return self._bytes

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Reads a `.model` file written by `save` (or by SentencePiece itself, if its special ids match)."""
        path = Path(path)
        try:
            model_bytes = path.read_bytes()
        except FileNotFoundError:
            raise DataError(f"{path}: tokenizer model file not found") from None
        except OSError as e:
            raise DataError(f"{path}: cannot read tokenizer model: {e.strerror or e}") from e
        return cls(model_bytes, source=str(path))

    def save(self, path: str | os.PathLike) -> None:
        """Writes the model as a SentencePiece `.model` file (readable by `load` and by the spm tools)."""
        Path(path).write_bytes(self._bytes)

    # --- using -------------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, specials included: ids are in [0, vocab_size)."""
        return self._processor.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Subword ids of one sentence, without BOS or EOS (see the module docstring for where they go)."""
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode takes one str, got {type(text).__name__}; use encode_batch")
        return self._processor.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` for many sentences in one call (faster than a Python loop)."""
        return self._processor.encode(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a model output row: stops at the first EOS and ignores PAD and BOS.

        `ids` may be a list or a 1-D numpy array. An id outside [0, vocab_size) is a ValueError: it means the
        model's vocabulary does not match this tokenizer.
        """
        kept = []
        for i in (int(x) for x in ids):
            if i == EOS_ID:
                break
            if i in (PAD_ID, BOS_ID):
                continue
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"Tokenizer.decode: id {i} is outside the vocabulary [0, {self.vocab_size})")
            kept.append(i)
        return self._processor.decode(kept)

    def pieces(self, text: str) -> list[str]:
        """The subword strings of `text` (for looking at what the tokenizer does)."""
        return self._processor.encode(text, out_type=str)


# =============================================================================================================
# 3. Encoding a corpus
# =============================================================================================================


@dataclasses.dataclass
class EncodedCorpus:
    """A corpus as id arrays, every pair short enough for `max_len`.

    `src[i]` is the encoder input: source tokens + [EOS]. `tgt[i]` holds the target tokens only; batching adds
    BOS (decoder input) and EOS (decoder target), so pair i needs max(len(src[i]), len(tgt[i]) + 1) positions.
    `line_numbers[i]` is the pair's line in the original file(s) and `corpus_index[i]` its index in the Corpus
    it was encoded from (pairs that were too long leave gaps in both).
    """

    src: list[np.ndarray]
    tgt: list[np.ndarray]
    line_numbers: list[int]
    corpus_index: list[int]
    origin: str
    max_len: int
    skipped_too_long: int = 0
    skipped_too_long_lines: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not len(self.src) == len(self.tgt) == len(self.line_numbers) == len(self.corpus_index):
            raise ValueError(
                f"{self.origin}: EncodedCorpus fields src, tgt, line_numbers and corpus_index must have the same length"
            )

    def __len__(self) -> int:
        return len(self.src)

    def positions_needed(self) -> np.ndarray:
        """For each pair, the sequence length it needs: max(source + EOS, BOS + target)."""
        return np.array([max(len(s), len(t) + 1) for s, t in zip(self.src, self.tgt)], dtype=np.int64)

    def describe(self) -> str:
        """One line for a log: pairs kept, and how many were too long for max_len (and where)."""
        text = f"{self.origin}: {len(self)} pairs encoded for max_len={self.max_len}"
        if self.skipped_too_long:
            text += f", skipped {self.skipped_too_long} too long{_lines_hint(self.skipped_too_long_lines)}"
        return text


def encode_corpus(corpus: Corpus, tokenizer: Tokenizer, max_len: int, *, on_too_long: str = "skip") -> EncodedCorpus:
    """Tokenizes every pair and checks it fits in `max_len` positions on both sides.

    A source of n tokens needs n + 1 positions (EOS), a target of n tokens n + 1 (BOS or EOS). A pair that does
    not fit is skipped and counted (on_too_long="skip"; see EncodedCorpus.describe) or is a DataError naming
    its line and lengths (on_too_long="error"). Nothing is ever truncated: a truncated target teaches the model
    to stop mid-sentence.
    """
    if on_too_long not in _ON_TOO_LONG:
        raise ValueError(f"on_too_long must be one of {_ON_TOO_LONG}, got {on_too_long!r}")
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 (one token plus EOS), got {max_len}")
    out = EncodedCorpus([], [], [], [], corpus.origin, max_len)
    eos = np.array([EOS_ID], dtype=np.int32)
    src_ids, tgt_ids = tokenizer.encode_batch(corpus.sources), tokenizer.encode_batch(corpus.targets)
    for index, (s, t, line) in enumerate(zip(src_ids, tgt_ids, corpus.line_numbers)):
        if len(s) + 1 > max_len or len(t) + 1 > max_len:
            if on_too_long == "error":
                raise DataError(
                    f"{_where(corpus.origin, line)}: pair too long for max_len={max_len}: the source "
                    f"has {len(s)} tokens (+1 for EOS), the target {len(t)} (+1 for BOS/EOS); "
                    f'pass on_too_long="skip" to skip such pairs, or raise max_len'
                )
            out.skipped_too_long += 1
            if len(out.skipped_too_long_lines) < MAX_REPORTED_LINES:
                out.skipped_too_long_lines.append(line)
            continue
        out.src.append(np.concatenate([np.asarray(s, dtype=np.int32), eos]))
        out.tgt.append(np.asarray(t, dtype=np.int32))
        out.line_numbers.append(line)
        out.corpus_index.append(index)
    return out


# =============================================================================================================
# 4. Batching by token count: packed rows or length buckets
# =============================================================================================================


def bucket_lengths(max_len: int) -> tuple[int, ...]:
    """The padded lengths batches may have: 8, 16, ..., 64, then about x1.25 per step (multiples of 8),
    and finally `max_len` itself.

    Fine steps where most sentences are keep padding low; coarser steps above keep the number of shapes (and
    of jit compilations) small: 14 buckets for max_len=256.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    ladder, length = [], 8
    while length < max_len:
        ladder.append(length)
        length = length + 8 if length < 64 else -(-(length * 5 // 4) // 8) * 8  # x1.25, rounded up to 8
    return tuple(ladder) + (max_len,)


def rows_per_batch(bucket_len: int, max_tokens: int, row_multiple: int = 1) -> int:
    """Rows of every batch of a bucket: max_tokens // bucket_len, rounded down to a multiple of row_multiple
    (so that a batch splits evenly over that many devices or micro-batches), but at least row_multiple."""
    rows = max(1, max_tokens // bucket_len) // row_multiple * row_multiple
    return max(rows, row_multiple)


class _Buckets:
    """Length buckets: which bucket each pair goes to, and how many rows each bucket's batches have. A plan item
    is (bucket index, pair indices with -1 for padding rows): one pair per row."""

    def __init__(self, encoded: EncodedCorpus, max_tokens: int, row_multiple: int) -> None:
        if len(encoded) == 0:
            raise DataError(f"{encoded.origin}: no sentence pairs to batch")
        if max_tokens < 1 or row_multiple < 1:
            raise ValueError(f"max_tokens and row_multiple must be >= 1, got {max_tokens} and {row_multiple}")
        self.encoded = encoded
        self.lengths = bucket_lengths(encoded.max_len)
        needed = encoded.positions_needed()
        _check_fits(encoded, needed, encoded.max_len, "max_len")
        # Each pair goes to the smallest bucket that holds it.
        bucket_of_pair = np.searchsorted(self.lengths, needed, side="left")
        self.members = [np.flatnonzero(bucket_of_pair == b) for b in range(len(self.lengths))]
        self.rows = [rows_per_batch(length, max_tokens, row_multiple) for length in self.lengths]
        self.needed = needed

    def plan(self, rng: np.random.Generator | None) -> list[tuple[int, np.ndarray]]:
        """The batches of one epoch as (bucket index, pair indices with -1 for padding rows).

        With an rng, pairs are shuffled within each bucket and then the batches are shuffled; without one the
        order is bucket by bucket, pairs in corpus order (for evaluation).
        """
        batches = []
        for b, members in enumerate(self.members):
            if rng is not None:
                members = rng.permutation(members)
            rows = self.rows[b]
            for start in range(0, len(members), rows):
                chunk = np.full(rows, -1, dtype=np.int64)  # -1: an all-padding row, keeping the batch shape
                part = members[start : start + rows]
                chunk[: len(part)] = part
                batches.append((b, chunk))
        if rng is not None:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def batches(self, rng: np.random.Generator | None) -> Iterator[tuple[int, np.ndarray]]:
        return iter(self.plan(rng))

    def collate(self, item: tuple[int, np.ndarray]) -> dict[str, np.ndarray]:
        """One padded batch: src, tgt_in, tgt_out, each of shape (rows, bucket length), dtype int32."""
        bucket, pair_indices = item
        shape = (len(pair_indices), self.lengths[bucket])
        src, tgt_in, tgt_out = (np.full(shape, PAD_ID, dtype=np.int32) for _ in range(3))
        for row, i in enumerate(pair_indices):
            if i < 0:
                continue
            s, t = self.encoded.src[i], self.encoded.tgt[i]
            src[row, : len(s)] = s
            tgt_in[row, 0] = BOS_ID
            tgt_in[row, 1 : len(t) + 1] = t
            tgt_out[row, : len(t)] = t
            tgt_out[row, len(t)] = EOS_ID
        return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}

    def index(self, item: tuple[int, np.ndarray]) -> np.ndarray:
        """(rows,): the pair in each row of the item's batch, -1 for a padding row."""
        return item[1]

    def batches_per_epoch(self) -> int:
        return sum(-(-len(m) // rows) for m, rows in zip(self.members, self.rows))  # ceil division

    def shapes(self) -> list[tuple[int, int]]:
        """(rows, length) of every bucket that holds at least one pair."""
        return [(self.rows[b], self.lengths[b]) for b in range(len(self.lengths)) if len(self.members[b])]

    def padding_efficiency(self) -> float:
        """Real tokens / token slots over one epoch, src and tgt_out together (see padding_efficiency())."""
        real = sum(len(s) + len(t) + 1 for s, t in zip(self.encoded.src, self.encoded.tgt))
        slots = sum(2 * self.rows[b] * self.lengths[b] * -(-len(m) // self.rows[b]) for b, m in enumerate(self.members))
        return real / slots


def _check_fits(encoded: EncodedCorpus, needed: np.ndarray, length: int, name: str) -> None:
    too_long = np.flatnonzero(needed > length)
    if too_long.size:  # for max_len possible only for an EncodedCorpus built by hand, not by encode_corpus
        i = int(too_long[0])
        raise DataError(
            f"{_where(encoded.origin, encoded.line_numbers[i])}: pair needs {needed[i]} positions, "
            f"more than {name}={length}"
            + (" (leave pack_length out to fit the longest pair, or lower max_len)" if name == "pack_length" else "")
        )


def default_pack_length(encoded: EncodedCorpus) -> int:
    """The row length of packed batches when none is given: the longest pair's positions, rounded up to a multiple
    of 8, but at most max_len. On Multi30k (longest pair 59 positions) that is 64."""
    if len(encoded) == 0:
        raise DataError(f"{encoded.origin}: no sentence pairs to batch")
    longest = int(encoded.positions_needed().max())
    return min(encoded.max_len, -(-longest // 8) * 8)


class _Packing:
    """Packed rows: every batch is (rows, length) with rows = max_tokens // length rounded down to a multiple of
    row_multiple (as for buckets: a batch splits over that many devices x micro-batches), and each row holds as many
    whole pairs, one after the other, as fit on both sides (source + EOS on the source side, BOS + target on the
    target side). A plan item is a batch's rows, each a list of pair indices in row order (segment 1, 2, ...).

    The packing is first fit, as the stream comes: pairs are taken in (shuffled) order and each goes into the
    first row of the open batch where both its sides still fit; a pair that fits nowhere closes the batch and
    opens the next one. Measured on Multi30k (29,000 pairs, 4,096 slots, length 64): 94% of source and 89% of
    target slots hold a real token (length buckets: 77% and 74%); first fit over every row of the epoch at once
    would reach only about 1% more, and waiting pairs (a look-ahead) about 0.8% more.
    """

    def __init__(
        self, encoded: EncodedCorpus, max_tokens: int, length: int | None, row_multiple: int = 1, seed: int = 0
    ) -> None:
        if len(encoded) == 0:
            raise DataError(f"{encoded.origin}: no sentence pairs to batch")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.encoded = encoded
        self.length = default_pack_length(encoded) if length is None else length
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 2:
            raise ValueError(f"pack_length must be an int >= 2 (a token and EOS), got {self.length!r}")
        self.src_len = np.array([len(s) for s in encoded.src], dtype=np.int64)  # source tokens + EOS
        self.tgt_len = np.array([len(t) + 1 for t in encoded.tgt], dtype=np.int64)  # BOS + target (= target + EOS)
        _check_fits(encoded, np.maximum(self.src_len, self.tgt_len), self.length, "pack_length")
        self.rows = rows_per_batch(self.length, max_tokens, row_multiple)
        self.seed = seed  # of the stream: its first epoch stands for all in `batches_per_epoch`
        self._first_epoch: list[list[list[int]]] | None = None
        # Every pair's tokens in one array per side, and where each pair's start (for `collate`).
        self._src_tokens = np.concatenate(encoded.src).astype(np.int32)
        self._src_start = np.cumsum(self.src_len) - self.src_len
        self._tgt_tokens = np.concatenate([*encoded.tgt, np.zeros(1, np.int32)]).astype(np.int32)
        self._tgt_start = np.cumsum(self.tgt_len - 1) - (self.tgt_len - 1)

    def plan(self, rng: np.random.Generator | None) -> list[list[list[int]]]:
        """The batches of one epoch: with an rng the pairs come in a random order, without one in corpus order."""
        return list(self.batches(rng))

    def batches(self, rng: np.random.Generator | None) -> Iterator[list[list[int]]]:
        """`plan`'s batches one at a time, each as soon as it is full: packing an epoch of Multi30k takes ~0.2 s,
        as long as a GPU needs for a hundred small steps, so a stream packs as it goes instead of stalling the run
        at every epoch's start."""
        order = rng.permutation(len(self.encoded)) if rng is not None else np.arange(len(self.encoded))
        rows: list[list[int]] = [[] for _ in range(self.rows)]
        src_free = np.full(self.rows, self.length)  # free positions left in each row of the open batch
        tgt_free = np.full(self.rows, self.length)
        for i in order.tolist():
            fits = np.flatnonzero((src_free >= self.src_len[i]) & (tgt_free >= self.tgt_len[i]))
            if fits.size == 0:  # the open batch is full for this pair: it opens the next one
                yield rows
                rows = [[] for _ in range(self.rows)]
                src_free[:], tgt_free[:] = self.length, self.length
                row = 0
            else:
                row = int(fits[0])
            rows[row].append(i)
            src_free[row] -= self.src_len[i]
            tgt_free[row] -= self.tgt_len[i]
        if any(rows):
            yield rows  # the last batch: its empty rows stay all padding

    def collate(self, rows: list[list[int]]) -> dict[str, np.ndarray]:
        """One packed batch: src, tgt_in, tgt_out and PACKING_KEYS, each of shape (rows, length), dtype int32.

        Row r holds its pairs one after the other: pair k of the row (segment id k + 1) puts source + EOS on the
        source side and BOS + target (tgt_in) / target + EOS (tgt_out) on the target side, each side starting where
        the previous pair's ended, positions counting from 0 again. Written as a few whole-batch numpy operations
        rather than a loop over pairs: a 25,000-slot batch holds over a thousand pairs, and the batch is cut in a
        background thread that shares the interpreter with the loop dispatching steps."""
        pairs = np.array([i for members in rows for i in members], dtype=np.int64)  # in row order
        row = np.repeat(np.arange(len(rows)), [len(members) for members in rows])  # (pairs,) row of each pair
        segment = np.concatenate([np.arange(1, len(members) + 1) for members in rows if members] or [[]])
        batch = {key: np.zeros((self.rows, self.length), dtype=np.int32) for key in ("src", "tgt_in", "tgt_out")}
        for side, lengths in (("src", self.src_len[pairs]), ("tgt", self.tgt_len[pairs])):
            start = np.cumsum(lengths) - lengths  # where each pair's tokens start in the batch's concatenation
            position = np.arange(lengths.sum()) - np.repeat(start, lengths)  # 0, 1, ... within each pair
            offset = start - start[np.searchsorted(row, row)]  # where each pair starts within its row
            where = (np.repeat(row, lengths), np.repeat(offset, lengths) + position)  # (row, column) of each token
            batch[f"{side}_segments"] = np.zeros_like(batch["src"])
            batch[f"{side}_segments"][where] = np.repeat(segment, lengths)
            batch[f"{side}_positions"] = np.zeros_like(batch["src"])
            batch[f"{side}_positions"][where] = position
            if side == "src":
                batch["src"][where] = self._src_tokens[np.repeat(self._src_start[pairs], lengths) + position]
            else:  # tgt_in = BOS, t_1 .. t_n and tgt_out = t_1 .. t_n, EOS: both read the target tokens t
                first, last = position == 0, position == np.repeat(lengths - 1, lengths)
                word = np.repeat(self._tgt_start[pairs], lengths) + position  # index of t_(position + 1)
                batch["tgt_in"][where] = np.where(first, BOS_ID, self._tgt_tokens[np.maximum(word - 1, 0)])
                batch["tgt_out"][where] = np.where(
                    last, EOS_ID, self._tgt_tokens[np.minimum(word, len(self._tgt_tokens) - 1)]
                )
        return batch

    def index(self, rows: list[list[int]]) -> np.ndarray:
        """(rows, most pairs in a row): index[r, k] is the pair with segment id k + 1 in row r, -1 where none."""
        out = np.full((self.rows, max(1, max(map(len, rows)))), -1, dtype=np.int64)
        for r, members in enumerate(rows):
            out[r, : len(members)] = members
        return out

    def _epoch0(self) -> list[list[list[int]]]:
        if self._first_epoch is None:
            self._first_epoch = self.plan(np.random.default_rng((self.seed, 0)))
        return self._first_epoch

    def batches_per_epoch(self) -> int:
        """Batches of the first epoch (the others' counts differ by a batch or two with the shuffle)."""
        return len(self._epoch0())

    def shapes(self) -> list[tuple[int, int]]:
        return [(self.rows, self.length)]

    def padding_efficiency(self) -> float:
        """Real tokens / token slots over a typical epoch, src and tgt_out together (see padding_efficiency())."""
        real = int(self.src_len.sum() + self.tgt_len.sum())
        return real / (2 * self.rows * self.length * self.batches_per_epoch())


def _plan_for(
    encoded: EncodedCorpus, max_tokens: int, batching: str, pack_length: int | None, row_multiple: int, seed: int = 0
) -> _Buckets | _Packing:
    if batching == "buckets":
        return _Buckets(encoded, max_tokens, row_multiple)
    if batching != "packed":
        raise ValueError(f"batching must be one of {BATCHINGS}, got {batching!r}")
    return _Packing(encoded, max_tokens, pack_length, row_multiple, seed)


def padding_efficiency(batches: Iterable[Mapping[str, np.ndarray]]) -> float:
    """Fraction of token slots holding a real token (not PAD) in `src` and `tgt_out` of the given batches.

    1.0 means no padding at all; padding rows and the padding within rows both lower it.
    """
    real = slots = 0
    for batch in batches:
        for key in ("src", "tgt_out"):
            real += int(np.count_nonzero(batch[key] != PAD_ID))
            slots += batch[key].size
    if slots == 0:
        raise ValueError("padding_efficiency: no batches given")
    return real / slots


class BatchStream:
    """An endless, reproducible stream of training batches: epoch after epoch, reshuffled each epoch.

    batching="packed": every batch is a dict of np.int32 arrays `src`, `tgt_in`, `tgt_out` and `PACKING_KEYS`, all
    of one shape (max_tokens // L, L), L = `pack_length` (default: the longest pair rounded up to a multiple of 8,
    at most max_len); each row holds several whole pairs. The number of batches varies a little from epoch to
    epoch (it depends on how the shuffled pairs pack).

    batching="buckets" (the default here; runs default to "packed", see `DataConfig`): `src`, `tgt_in`, `tgt_out`
    of one shape (rows, L) per length bucket (see `shapes`), one pair per row; rows is a multiple of
    `row_multiple`, so a batch splits evenly over that many devices; the last batch of a bucket is completed with
    all-padding rows.

    Either way a batch holds about `max_tokens` slots (rows * L) per array, all devices together (the paper's steps
    of ~25,000 source and ~25,000 target tokens are max_tokens=25_000); a sentence longer than max_tokens still
    gets a batch of one row. Padding counts no tokens: the loss must be normalised by the number of non-PAD targets.

    Epoch e is shuffled by np.random.default_rng((seed, e)), so the stream depends only on the data, the batching
    settings and seed. `state()` is the position in it (plain ints); a stream built with `state=` (or given it via
    `restore`) continues exactly where the saved one stood, so a resumed run sees the same batches as an
    uninterrupted one.
    """

    def __init__(
        self,
        encoded: EncodedCorpus,
        max_tokens: int,
        *,
        batching: str = "buckets",
        pack_length: int | None = None,
        row_multiple: int = 1,
        seed: int = 0,
        state: Mapping[str, int] | None = None,
    ) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"BatchStream: seed must be an int >= 0, got {seed!r}")
        self._batches = _plan_for(encoded, max_tokens, batching, pack_length, row_multiple, seed)
        self.batching = batching
        self.seed = seed
        self.batches_per_epoch = self._batches.batches_per_epoch()
        self._epoch, self._index = 0, 0
        self._plan: Iterator | None = None  # this epoch's remaining batches, cut as they are needed
        self._next: Any = None  # the next batch of the epoch (looked at ahead, to know when the epoch ends)
        if state is not None:
            self.restore(state)

    def __iter__(self) -> BatchStream:
        return self

    def _start_epoch(self) -> None:
        """Begins the current epoch's batches at `_index` (skipping those before it, after a restore)."""
        self._plan = self._batches.batches(np.random.default_rng((self.seed, self._epoch)))
        for _ in range(self._index):
            next(self._plan, None)
        self._next = next(self._plan, None)

    def __next__(self) -> dict[str, np.ndarray]:
        if self._plan is None:
            self._start_epoch()
        item, self._next = self._next, next(self._plan, None)
        self._index += 1
        if self._next is None:  # that was the epoch's last batch
            self._epoch, self._index, self._plan = self._epoch + 1, 0, None
        return self._batches.collate(item)

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to (0-based)."""
        return self._epoch

    def state(self) -> dict[str, int]:
        """The position in the stream as JSON-able ints: the next batch is batch `index` of epoch `epoch`.

        `batches_per_epoch` (packed: of the first epoch; the others differ by a batch or two) is included so that
        restoring into a stream over other data or other batch settings is caught.
        """
        return {"epoch": self._epoch, "index": self._index, "batches_per_epoch": self.batches_per_epoch}

    def restore(self, state: Mapping[str, int]) -> None:
        """Moves to a position saved by `state()`."""
        try:
            epoch, index = state["epoch"], state["index"]
        except (KeyError, TypeError):
            raise ValueError(f"BatchStream.restore: expected a dict with 'epoch' and 'index', got {state!r}") from None
        for name, value in (("epoch", epoch), ("index", index)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"BatchStream.restore: {name} must be an int >= 0, got {value!r}")
        saved = state.get("batches_per_epoch", self.batches_per_epoch)
        self._epoch, self._index = epoch, index
        self._start_epoch()
        if saved != self.batches_per_epoch or self._next is None:
            raise ValueError(
                f"BatchStream.restore: the state (batch {index} of epoch {epoch}, {saved} batches per epoch) does "
                f"not fit this stream ({self.batches_per_epoch} batches per epoch); was it saved with other data, "
                f"max_tokens, batching, pack_length or row_multiple?"
            )

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, length) a batch can have, shortest first: one per non-empty bucket, or the packed shape."""
        return self._batches.shapes()

    @property
    def padding_efficiency(self) -> float:
        """Real tokens / slots over an epoch (buckets: every epoch; packed: a typical one); see the function
        padding_efficiency."""
        return self._batches.padding_efficiency()

    def example_batches(self) -> list[dict[str, np.ndarray]]:
        """One all-padding batch of every shape and key the stream yields: what a step is compiled for ahead."""
        keys = ("src", "tgt_in", "tgt_out") + (PACKING_KEYS if self.batching == "packed" else ())
        return [{key: np.zeros(shape, dtype=np.int32) for key in keys} for shape in self.shapes]


def eval_batches(
    encoded: EncodedCorpus,
    max_tokens: int,
    *,
    batching: str = "buckets",
    pack_length: int | None = None,
    row_multiple: int = 1,
) -> list[tuple[dict[str, np.ndarray], np.ndarray]]:
    """One deterministic pass over `encoded` for evaluation, batched like BatchStream but not shuffled.

    Returns (batch, index) pairs so that outputs can be put back in corpus order (`encoded.line_numbers[i]` gives
    the file line of pair i). Buckets: index[r] is the pair in row r, or -1 for a padding row. Packed (one batch
    shape for the whole pass, so an evaluation step compiles once): index[r, k] is the pair with segment id k + 1
    in row r, or -1.
    """
    batches = _plan_for(encoded, max_tokens, batching, pack_length, row_multiple)
    return [(batches.collate(item), batches.index(item)) for item in batches.plan(None)]


# =============================================================================================================
# 5. A run's data settings
# =============================================================================================================


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where a training run's text comes from and how it is cut into batches. No files at all means the built-in
    English -> French numbers task (`jax_transformer.default_task`). Paths are stored as given; `absolute()`
    makes them absolute before they go into a checkpoint, so a resume from another directory finds them."""

    src: str | None = setting(None, "training source sentences, one per line (line-aligned with --tgt)")
    tgt: str | None = setting(None, "training target sentences, one per line")
    tsv: str | None = setting(None, "training pairs as source<TAB>target lines (instead of --src/--tgt)")
    valid_src: str | None = setting(None, "validation source sentences (for loss, BLEU, chrF)")
    valid_tgt: str | None = setting(None, "validation target sentences")
    valid_tsv: str | None = setting(None, "validation pairs as source<TAB>target lines")
    vocab_size: int = setting(8000, "joint SentencePiece vocabulary size, an upper bound")
    tokenizer_type: str = setting("unigram", "SentencePiece model type", choices=("unigram", "bpe"))
    max_tokens: int = setting(4096, "token slots per batch (rows x padded length), all devices together")
    row_multiple: int = setting(
        8,
        "rows of every batch are a multiple of this (rounded down, at least this many), so a batch splits evenly "
        "over that many devices x micro-batches; part of the batch plan, so a resume on another device count sees "
        "the same batches (8, as fairseq's --required-batch-size-multiple)",
    )
    batching: str = setting(
        "packed",
        "packed: several pairs per row, every batch one shape (one compilation); buckets: one pair per row, "
        "one batch shape (and compilation) per length bucket",
        choices=BATCHINGS,
    )
    pack_length: int | None = setting(
        None, "row length of packed batches (default: the longest pair rounded up to a multiple of 8, at most max_len)"
    )
    on_empty: str = setting(
        "skip", "a pair with an empty side: skip and count it, or stop with an error naming the line", choices=_ON_EMPTY
    )
    on_too_long: str = setting(
        "skip",
        "a pair longer than max_len tokens: skip and count it, or stop with an error naming the line",
        choices=_ON_TOO_LONG,
    )

    def __post_init__(self) -> None:
        for split, (src, tgt, tsv) in (
            ("training", (self.src, self.tgt, self.tsv)),
            ("validation", (self.valid_src, self.valid_tgt, self.valid_tsv)),
        ):
            if tsv is not None and (src is not None or tgt is not None):
                raise DataError(f"{split} data: give either a TSV file or a source and a target file, not both")
            if (src is None) != (tgt is None):
                given, missing = ("source", "target") if tgt is None else ("target", "source")
                raise DataError(f"{split} data: a {given} file was given without its {missing} file")
        if self.uses_default_task and (self.valid_src or self.valid_tsv):
            raise DataError("validation files were given without training files (the built-in task has its own)")
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 4:
            raise DataError(
                f"data field 'vocab_size' must be an int >= 4 (pad, bos, eos, unk), got {self.vocab_size!r}"
            )
        for name in ("max_tokens", "row_multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DataError(f"data field {name!r} must be an int >= 1, got {value!r}")
        length = self.pack_length
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 2):
            raise DataError(f"data field 'pack_length' must be an int >= 2 (a token and EOS), got {length!r}")
        for name, allowed in (
            ("tokenizer_type", ("unigram", "bpe")),
            ("batching", BATCHINGS),
            ("on_empty", _ON_EMPTY),
            ("on_too_long", _ON_TOO_LONG),
        ):
            if getattr(self, name) not in allowed:
                raise DataError(f"data field {name!r} must be one of {allowed}, got {getattr(self, name)!r}")
        if length is not None and self.batching != "packed":
            raise DataError(f"data field 'pack_length' ({length}) needs batching='packed', got {self.batching!r}")

    @property
    def uses_default_task(self) -> bool:
        return self.src is None and self.tsv is None

    @property
    def has_validation(self) -> bool:
        return self.uses_default_task or self.valid_src is not None or self.valid_tsv is not None

    def absolute(self) -> DataConfig:
        """The same settings with every file path made absolute."""
        paths = {
            name: str(Path(getattr(self, name)).absolute()) for name in _PATH_FIELDS if getattr(self, name) is not None
        }
        return dataclasses.replace(self, **paths)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "data settings") -> DataConfig:
        return settings_from_dict(cls, values, source)


_PATH_FIELDS = ("src", "tgt", "tsv", "valid_src", "valid_tgt", "valid_tsv")


def load_corpus(data: DataConfig, split: str = "train") -> Corpus | None:
    """Reads the training ("train") or validation ("valid") pairs that `data` names (DataError naming the file
    and line for bad input); None for "valid" when there are no validation files."""
    if split not in ("train", "valid"):
        raise ValueError(f"split must be 'train' or 'valid', got {split!r}")
    if data.uses_default_task:
        from jax_transformer import (
            default_task,  # the built-in task is a data source like a file
        )

        return default_task.default_pairs(split)
    prefix = "" if split == "train" else "valid_"
    src, tgt, tsv = (getattr(data, prefix + name) for name in ("src", "tgt", "tsv"))
    if tsv is not None:
        return read_tsv(tsv, on_empty=data.on_empty)
    if src is not None:
        return read_parallel(src, tgt, on_empty=data.on_empty)
    return None


def corpus_fingerprint(corpus: Corpus) -> str:
    """A hash of the pairs' text: a resumed run checks that it sees the same training data."""
    import hashlib

    digest = hashlib.sha256()
    for source, target in zip(corpus.sources, corpus.targets):
        digest.update(source.encode("utf-8") + b"\t" + target.encode("utf-8") + b"\n")
    return digest.hexdigest()[:16]
