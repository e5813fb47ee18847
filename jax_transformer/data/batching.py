"""From pairs of strings to batches: `encode_corpus` turns a Corpus into id arrays that fit `max_len`, and
`BatchStream` (training) and `eval_batches` (evaluation) cut them into batches of about `max_tokens` token slots:
- "packed" (the default, as in Flax's WMT example): several pairs one after the other in each row, every batch of
  one shape, so a jitted step compiles once; segment ids and positions (`PACKING_KEYS`) tell the model where each
  pair starts, so every pair gets exactly the logits it gets alone;
- "buckets" (like fairseq and tensor2tensor): one pair per row, pairs of similar length together, one shape per
  length bucket.
Conventions (ids pad 0, bos 1, eos 2): src = source tokens + [EOS], tgt_in = [BOS] + target tokens, tgt_out =
target tokens + [EOS], all padded on the right to the batch's one length. Plain numpy, no jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from jax_transformer.data.corpus import MAX_REPORTED_LINES, Corpus, lines_hint, location
from jax_transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from jax_transformer.errors import DataError
from jax_transformer.settings.config import BATCHINGS

_ON_TOO_LONG = ("skip", "error")

# What a packed batch carries besides src, tgt_in and tgt_out (the model's keyword arguments of the same names):
# segment ids 1, 2, ... per pair along a row (0 = padding) and each token's position within its own pair.
PACKING_KEYS = ("src_segments", "tgt_segments", "src_positions", "tgt_positions")


class Ragged:
    """Many token sequences in one flat array: sequence i is `tokens[offsets[r] : offsets[r + 1]]` with r = `rows[i]`
    (`rows` None: r = i). The same over numpy arrays in memory and over memory-mapped files (`token_arrays`), so a
    corpus of millions of pairs is read only where a batch needs it; what is held in memory is `lengths`, 4 bytes a
    sequence (and `rows`, when some of a file's sequences are left out)."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, rows: np.ndarray | None = None) -> None:
        self.tokens, self.offsets, self.rows = tokens, offsets, rows
        lengths = np.diff(offsets)
        self.lengths = (lengths if rows is None else lengths[rows]).astype(np.int32)  # (n,)

    @classmethod
    def of(cls, sequences: Iterable[np.ndarray]) -> Ragged:
        """From a list of 1-D id arrays."""
        sequences = [np.asarray(s, dtype=np.int32).reshape(-1) for s in sequences]
        offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
        np.cumsum([len(s) for s in sequences], out=offsets[1:])
        return cls(np.concatenate(sequences) if sequences else np.zeros(0, np.int32), offsets)

    def __len__(self) -> int:
        return len(self.lengths)

    def starts(self, index: np.ndarray | int) -> np.ndarray:
        """Where the given sequences start in `tokens`."""
        return np.asarray(self.offsets[index if self.rows is None else self.rows[index]])

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.starts(i))
        return np.asarray(self.tokens[start : start + int(self.lengths[i])], dtype=np.int32)

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))

    def gather(self, index: np.ndarray) -> np.ndarray:
        """The tokens of the given sequences, one after the other: one read of just those places of `tokens`."""
        lengths = self.lengths[index].astype(np.int64)
        within = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # 0, 1, .. per sequence
        return np.asarray(self.tokens[np.repeat(self.starts(index), lengths) + within], dtype=np.int32)


@dataclasses.dataclass
class EncodedCorpus:
    """A corpus as id arrays, every pair short enough for `max_len`.

    `src[i]` is the encoder input: source tokens + [EOS]. `tgt[i]` holds the target tokens only; batching adds
    BOS (decoder input) and EOS (decoder target), so pair i needs max(len(src[i]), len(tgt[i]) + 1) positions.
    `line_numbers[i]` is the pair's line in the original file(s) and `corpus_index[i]` its index in the Corpus
    it was encoded from (pairs that were too long leave gaps in both). src and tgt may be given as lists of arrays
    (kept as `Ragged`); `token_arrays.open_encoded` builds one over memory-mapped files.
    """

    src: Ragged
    tgt: Ragged
    line_numbers: Sequence[int]
    corpus_index: Sequence[int]
    origin: str
    max_len: int
    skipped_too_long: int = 0
    skipped_too_long_lines: list[int] = dataclasses.field(default_factory=list)
    ids: SpecialIds = dataclasses.field(default_factory=lambda: SpecialIds())  # the tokenizer's pad, start, eos

    def __post_init__(self) -> None:
        self.src = self.src if isinstance(self.src, Ragged) else Ragged.of(self.src)
        self.tgt = self.tgt if isinstance(self.tgt, Ragged) else Ragged.of(self.tgt)
        if not len(self.src) == len(self.tgt) == len(self.line_numbers) == len(self.corpus_index):
            raise ValueError(
                f"{self.origin}: EncodedCorpus fields src, tgt, line_numbers and corpus_index must have the same length"
            )

    def __len__(self) -> int:
        return len(self.src)

    def positions_needed(self) -> np.ndarray:
        """For each pair, the sequence length it needs: max(source + EOS, BOS + target)."""
        return np.maximum(self.src.lengths, self.tgt.lengths + 1).astype(np.int64)

    def describe(self) -> str:
        """One line for a log: pairs kept, and how many were too long for max_len (and where)."""
        text = f"{self.origin}: {len(self)} pairs encoded for max_len={self.max_len}"
        if self.skipped_too_long:
            text += f", skipped {self.skipped_too_long} too long{lines_hint(self.skipped_too_long_lines)}"
        return text


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """The ids batches are built with: padding, the decoder's first input (tgt_in[0]) and the end of sentence
    (appended to sources and to tgt_out). The joint SentencePiece tokenizer's: 0, 1, 2."""

    pad: int = PAD_ID
    start: int = BOS_ID
    eos: int = EOS_ID

    @classmethod
    def of(cls, tokenizer) -> SpecialIds:
        return cls(tokenizer.pad_id, tokenizer.start_id, tokenizer.eos_id)


def encode_corpus(corpus: Corpus, tokenizer: Tokenizer, max_len: int, *, on_too_long: str = "skip") -> EncodedCorpus:
    """Tokenizes every pair (in memory: validation data, the built-in task; a training file goes through
    `token_arrays`, encoded once onto disk) and keeps the pairs that fit `max_len` (see `fitting`)."""
    check_fitting(max_len, on_too_long)
    ids = SpecialIds.of(tokenizer)
    eos = np.array([ids.eos], dtype=np.int32)
    src_ids, tgt_ids = encode_sides(
        tokenizer, corpus.sources, corpus.targets, corpus.languages, corpus.line_numbers, corpus.origin
    )
    src = Ragged.of([np.concatenate([np.asarray(s, dtype=np.int32), eos]) for s in src_ids])
    tgt = Ragged.of(tgt_ids)
    lines = np.asarray(corpus.line_numbers, dtype=np.int64)
    return fitting(src, tgt, lines, corpus.origin, max_len, on_too_long, ids)


def encode_sides(
    tokenizer,
    sources: Sequence[str],
    targets: Sequence[str],
    languages: Sequence[tuple[str, str]] | None = None,
    line_numbers: Sequence[int] = (),
    origin: str = "",
) -> tuple[list[list[int]], list[list[int]]]:
    """The sources' and the targets' ids. With `languages` (a corpus of many language pairs), each sentence is
    marked with its own pair's code, as the tokenizer marks every sentence with --src-lang's / --tgt-lang's: the
    target's code is its first token, so teacher forcing trains each row into its own language. A code the
    tokenizer does not know is a DataError naming the line."""
    if languages is None:
        return tokenizer.encode_batch(list(sources)), tokenizer.encode_batch(list(targets), side="target")
    check_language_codes(tokenizer, languages, line_numbers, origin)
    return (
        tokenizer.encode_with_codes(sources, [pair[0] for pair in languages]),
        tokenizer.encode_with_codes(targets, [pair[1] for pair in languages]),
    )


def check_language_codes(
    tokenizer, languages: Sequence[tuple[str, str]], line_numbers: Sequence[int], origin: str
) -> None:
    """Every code of `languages` is one of the tokenizer's, else a DataError at the first line that has one that
    is not (with the closest codes); a tokenizer without codes takes no language columns."""
    if not hasattr(tokenizer, "codes"):
        raise DataError(
            f"{origin}: language columns need a multilingual model's tokenizer (NLLB-200, M2M-100, mBART-50: "
            f"import one and train --init-from it); this one ({getattr(tokenizer, 'kind', 'sentencepiece')}) has no "
            f"language codes"
        )
    for column, side in ((0, "source"), (1, "target")):
        unknown = {pair[column] for pair in languages} - set(tokenizer.codes)
        if unknown:
            i = next(i for i, pair in enumerate(languages) if pair[column] in unknown)
            where = location(origin, int(line_numbers[i])) if len(line_numbers) else origin
            tokenizer.checked_language(languages[i][column], f"{where}: the {side} language column")


def check_fitting(max_len: int, on_too_long: str) -> None:
    if on_too_long not in _ON_TOO_LONG:
        raise ValueError(f"on_too_long must be one of {_ON_TOO_LONG}, got {on_too_long!r}")
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 (one token plus EOS), got {max_len}")


def fitting(
    src: Ragged, tgt: Ragged, line_numbers: np.ndarray, origin: str, max_len: int, on_too_long: str, ids: SpecialIds
) -> EncodedCorpus:
    """The encoded pairs (sources with their EOS) that fit in `max_len` positions on both sides.

    A source of n tokens needs n + 1 positions (EOS), a target of n tokens n + 1 (BOS or EOS). A pair that does
    not fit is skipped and counted (on_too_long="skip"; see EncodedCorpus.describe) or is a DataError naming
    its line and lengths (on_too_long="error"). Nothing is ever truncated: a truncated target teaches the model
    to stop mid-sentence. Whole-array operations: the lengths of millions of pairs are compared at once.
    """
    check_fitting(max_len, on_too_long)
    too_long_mask = (src.lengths > max_len) | (tgt.lengths + 1 > max_len)
    too_long = np.flatnonzero(too_long_mask)
    if too_long.size and on_too_long == "error":
        i = int(too_long[0])
        raise DataError(
            f"{location(origin, int(line_numbers[i]))}: pair too long for max_len={max_len}: the source "
            f"has {src.lengths[i] - 1} tokens (+1 for EOS), the target {tgt.lengths[i]} (+1 for BOS/EOS); "
            f'pass on_too_long="skip" to skip such pairs, or raise max_len'
        )
    if not too_long.size:
        return EncodedCorpus(src, tgt, line_numbers, range(len(src)), origin, max_len, ids=ids)
    keep = np.flatnonzero(~too_long_mask)
    assert src.rows is None and tgt.rows is None, "fitting takes every pair of its arrays"
    return EncodedCorpus(
        Ragged(src.tokens, src.offsets, keep),
        Ragged(tgt.tokens, tgt.offsets, keep),
        np.asarray(line_numbers[keep]),
        keep,
        origin,
        max_len,
        skipped_too_long=int(too_long.size),
        skipped_too_long_lines=[int(line_numbers[i]) for i in too_long[:MAX_REPORTED_LINES]],
        ids=ids,
    )


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

    def batches(self, rng: np.random.Generator | None) -> Iterator[tuple[Any, None]]:
        """`plan`'s batches, each with None: a bucket plan has no position to resume from but its index."""
        return ((item, None) for item in self.plan(rng))

    def collate(self, item: tuple[int, np.ndarray], mine: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """One padded batch: src, tgt_in, tgt_out, each of shape (rows, bucket length), dtype int32; with `mine`,
        only those rows of it."""
        bucket, pair_indices = item
        pair_indices = pair_indices if mine is None else pair_indices[mine]
        shape = (len(pair_indices), self.lengths[bucket])
        ids = self.encoded.ids
        src, tgt_in, tgt_out = (np.full(shape, ids.pad, dtype=np.int32) for _ in range(3))
        for row, i in enumerate(pair_indices):
            if i < 0:
                continue
            s, t = self.encoded.src[i], self.encoded.tgt[i]
            src[row, : len(s)] = s
            tgt_in[row, 0] = ids.start
            tgt_in[row, 1 : len(t) + 1] = t
            tgt_out[row, : len(t)] = t
            tgt_out[row, len(t)] = ids.eos
        return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}

    def index(self, item: tuple[int, np.ndarray]) -> np.ndarray:
        """(rows,): the pair in each row of the item's batch, -1 for a padding row."""
        return item[1]

    def batches_per_epoch(self) -> int:
        return sum(-(-len(m) // rows) for m, rows in zip(self.members, self.rows))  # ceil division

    def key(self) -> tuple:
        """What decides the plan besides the seed (see BatchStream.plan_key)."""
        return ("buckets", self.lengths, tuple(self.rows), self.needed)

    def shapes(self) -> list[tuple[int, int]]:
        """(rows, length) of every bucket that holds at least one pair."""
        return [(self.rows[b], self.lengths[b]) for b in range(len(self.lengths)) if len(self.members[b])]

    def padding_efficiency(self) -> float:
        """Real tokens / token slots over one epoch, src and tgt_out together (see padding_efficiency())."""
        real = int(self.encoded.src.lengths.sum()) + int(self.encoded.tgt.lengths.sum()) + len(self.encoded)
        slots = sum(2 * self.rows[b] * self.lengths[b] * -(-len(m) // self.rows[b]) for b, m in enumerate(self.members))
        return real / slots


def _check_fits(encoded: EncodedCorpus, needed: np.ndarray, length: int, name: str) -> None:
    too_long = np.flatnonzero(needed > length)
    if too_long.size:  # for max_len possible only for an EncodedCorpus built by hand, not by encode_corpus
        i = int(too_long[0])
        raise DataError(
            f"{location(encoded.origin, encoded.line_numbers[i])}: pair needs {needed[i]} positions, "
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
    opens the next one. Packing over a whole epoch at once, or waiting pairs (a look-ahead), fills barely more
    slots (docs/training.md, "Batching and compilation", has the shares measured on Multi30k). A batch begins
    with empty rows, so the pair where it begins in the epoch's order (its `position`) is all a resume needs.
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
        self.src_len = encoded.src.lengths  # (pairs,) source tokens + EOS
        self.tgt_len = encoded.tgt.lengths + 1  # (pairs,) BOS + target (= target + EOS)
        _check_fits(encoded, np.maximum(self.src_len, self.tgt_len), self.length, "pack_length")
        self.rows = rows_per_batch(self.length, max_tokens, row_multiple)
        self.seed = seed  # of the stream: its first epoch stands for all in `batches_per_epoch`
        self._batches_per_epoch: int | None = None

    def plan(self, rng: np.random.Generator | None) -> list[list[list[int]]]:
        """The batches of one epoch: with an rng the pairs come in a random order, without one in corpus order."""
        return [rows for rows, _ in self.batches(rng)]

    # Pairs whose first fits are looked up at once, against the open batch's free space when the block starts.
    _BLOCK = 64

    def batches(self, rng: np.random.Generator | None, position: int = 0) -> Iterator[tuple[list[list[int]], int]]:
        """`plan`'s batches one at a time, each as soon as it is full, with the position in the epoch's order where
        the next batch begins; from `position` on (where a batch began). Packing a whole epoch takes as long as a
        GPU needs for many small steps, so a stream packs as it goes instead of stalling the run at every epoch's
        start (docs/benchmarks.md).

        First fit, computed a block of pairs at a time: the first row each pair of the block fits in is found for
        all of them at once (a (block, rows) comparison), against the free space when the block starts. Free
        space only shrinks until the batch closes, so no row before that one can take the pair later either: the
        pair goes into that row or, if the block's earlier pairs filled it, a later one, found by a short scan.
        The result is the one-pair-at-a-time first fit's, pair for pair (tests/test_data.py compares them)."""
        n = len(self.encoded)
        order = rng.permutation(n) if rng is not None else np.arange(n)
        length, count = self.length, self.rows
        rows: list[list[int]] = [[] for _ in range(count)]
        src_free, tgt_free = [length] * count, [length] * count  # free positions left in each row of the open batch
        p = position
        while p < n:
            block = order[p : p + self._BLOCK]
            need_src, need_tgt = self.src_len[block], self.tgt_len[block]
            fits = (np.asarray(src_free) >= need_src[:, None]) & (np.asarray(tgt_free) >= need_tgt[:, None])
            first = np.where(fits.any(axis=1), fits.argmax(axis=1), count).tolist()
            for j, (pair, a, b) in enumerate(zip(block.tolist(), need_src.tolist(), need_tgt.tolist())):
                row = first[j]
                while row < count and (src_free[row] < a or tgt_free[row] < b):
                    row += 1
                if row == count:  # the open batch is full for this pair: it opens the next one
                    yield rows, p + j
                    rows = [[] for _ in range(count)]
                    src_free, tgt_free = [length] * count, [length] * count
                    p += j  # a new block from this pair: the looked-up rows were of the closed batch
                    break
                rows[row].append(pair)
                src_free[row] -= a
                tgt_free[row] -= b
            else:
                p += len(block)
        if any(rows):
            yield rows, n  # the last batch: its empty rows stay all padding

    def collate(self, rows: list[list[int]], mine: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """One packed batch: src, tgt_in, tgt_out and PACKING_KEYS, each of shape (rows, length), dtype int32; with
        `mine`, only those rows of it.

        Row r holds its pairs one after the other: pair k of the row (segment id k + 1) puts source + EOS on the
        source side and BOS + target (tgt_in) / target + EOS (tgt_out) on the target side, each side starting where
        the previous pair's ended, positions counting from 0 again. Written as a few whole-batch numpy operations
        rather than a loop over pairs: a 25,000-slot batch holds over a thousand pairs, and the batch is cut in a
        background thread that shares the interpreter with the loop dispatching steps."""
        rows = rows if mine is None else [rows[r] for r in mine]
        pairs = np.array([i for members in rows for i in members], dtype=np.int64)  # in row order
        row = np.repeat(np.arange(len(rows)), [len(members) for members in rows])  # (pairs,) row of each pair
        segment = np.concatenate([np.arange(1, len(members) + 1) for members in rows if members] or [[]])
        ids = self.encoded.ids
        shape = (len(rows), self.length)
        batch = {key: np.full(shape, ids.pad, np.int32) for key in ("src", "tgt_in", "tgt_out")}
        # The pairs' tokens one after the other, each side read once; targets with BOS before / EOS after each.
        targets = self.encoded.tgt.gather(pairs)
        target_ends = np.cumsum(self.tgt_len[pairs] - 1)
        tokens = {
            "src": self.encoded.src.gather(pairs),
            "tgt_in": np.insert(targets, target_ends - (self.tgt_len[pairs] - 1), ids.start),
            "tgt_out": np.insert(targets, target_ends, ids.eos),
        }
        for side, lengths in (("src", self.src_len[pairs]), ("tgt", self.tgt_len[pairs])):
            lengths = lengths.astype(np.int64)
            start = np.cumsum(lengths) - lengths  # where each pair's tokens start in the batch's concatenation
            position = np.arange(lengths.sum()) - np.repeat(start, lengths)  # 0, 1, ... within each pair
            offset = start - start[np.searchsorted(row, row)]  # where each pair starts within its row
            where = (np.repeat(row, lengths), np.repeat(offset, lengths) + position)  # (row, column) of each token
            batch[f"{side}_segments"] = np.zeros(shape, np.int32)
            batch[f"{side}_segments"][where] = np.repeat(segment, lengths)
            batch[f"{side}_positions"] = np.zeros(shape, np.int32)
            batch[f"{side}_positions"][where] = position
            for key in ("src",) if side == "src" else ("tgt_in", "tgt_out"):
                batch[key][where] = tokens[key]
        return batch

    def index(self, rows: list[list[int]]) -> np.ndarray:
        """(rows, most pairs in a row): index[r, k] is the pair with segment id k + 1 in row r, -1 where none."""
        out = np.full((self.rows, max(1, max(map(len, rows)))), -1, dtype=np.int64)
        for r, members in enumerate(rows):
            out[r, : len(members)] = members
        return out

    def batches_per_epoch(self) -> int:
        """Batches of the first epoch (the others' counts differ by a batch or two with the shuffle): one packing
        pass, the first time it is asked."""
        if self._batches_per_epoch is None:
            self._batches_per_epoch = sum(1 for _ in self.batches(np.random.default_rng((self.seed, 0))))
        return self._batches_per_epoch

    def key(self) -> tuple:
        """What decides the plan besides the seed (see BatchStream.plan_key)."""
        return ("packed", self.length, self.rows, self.src_len, self.tgt_len)

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


def padding_efficiency(batches: Iterable[Mapping[str, np.ndarray]], pad_id: int = PAD_ID) -> float:
    """Fraction of token slots holding a real token (not PAD) in `src` and `tgt_out` of the given batches.

    1.0 means no padding at all; padding rows and the padding within rows both lower it.
    """
    real = slots = 0
    for batch in batches:
        for key in ("src", "tgt_out"):
            real += int(np.count_nonzero(batch[key] != pad_id))
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
    settings and seed. `state()` is the position in it (plain ints and a key); a stream built with `state=` (or
    given it via `restore`) continues exactly where the saved one stood, so a resumed run sees the same batches as
    an uninterrupted one. With `process_rows` (a function of a batch's rows giving the indices of this process's
    rows, `DataParallel.process_rows`) each batch holds only those rows: each process of a multi-process run reads
    only its share of the corpus; `global_rows` gives the whole batch's rows.
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
        state: Mapping[str, Any] | None = None,
        process_rows: Callable[[int], np.ndarray] | None = None,
    ) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"BatchStream: seed must be an int >= 0, got {seed!r}")
        self._batches = _plan_for(encoded, max_tokens, batching, pack_length, row_multiple, seed)
        self.batching = batching
        self.seed = seed
        self.process_rows = process_rows
        self.plan_key = _digest((self._batches.key(), seed))
        self._epoch, self._index = 0, 0
        self._epoch_start = 0 if batching == "packed" else None  # where an epoch's first batch begins (packed)
        self._position = self._epoch_start  # where the next batch begins
        self._plan: Iterator | None = None  # this epoch's remaining batches, cut as they are needed
        self._next: Any = None  # the next batch of the epoch (looked at ahead, to know when the epoch ends)
        if state is not None:
            self.restore(state)

    def __iter__(self) -> BatchStream:
        return self

    @property
    def batches_per_epoch(self) -> int:
        """Batches of an epoch (packed: of the first; the others differ by a batch or two with the shuffle)."""
        return self._batches.batches_per_epoch()

    def _start_epoch(self, position: int | None = None) -> None:
        """Begins the current epoch's batches at `_index`: at `position` in the epoch's order where that batch
        begins (packed), else by cutting and skipping the batches before it."""
        rng = np.random.default_rng((self.seed, self._epoch))
        if position is not None and self.batching == "packed":
            self._plan, self._position = self._batches.batches(rng, position), position
        else:
            self._plan, self._position = self._batches.batches(rng), self._epoch_start
            for _ in range(self._index):
                skipped = next(self._plan, None)
                if skipped is not None:  # where the batch after it begins: what `state` saves from now on
                    self._position = skipped[1]
        self._next = next(self._plan, None)

    def __next__(self) -> dict[str, np.ndarray]:
        if self._plan is None:
            self._start_epoch()
        (item, self._position), self._next = self._next, next(self._plan, None)
        self._index += 1
        if self._next is None:  # that was the epoch's last batch
            self._epoch, self._index, self._plan, self._position = self._epoch + 1, 0, None, self._epoch_start
        if self.process_rows is None:
            return self._batches.collate(item)
        return self._batches.collate(item, self.process_rows(len(item) if self.batching == "packed" else len(item[1])))

    def global_rows(self, batch: Mapping[str, np.ndarray]) -> int | None:
        """The rows of the whole batch of which `batch` is this process's share; None when batches are whole."""
        if self.process_rows is None:
            return None
        return {length: rows for rows, length in self.shapes}[batch["src"].shape[1]]

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to (0-based)."""
        return self._epoch

    def state(self) -> dict[str, Any]:
        """The position in the stream, JSON-able: the next batch is batch `index` of epoch `epoch`, and (packed)
        begins at `position` in the epoch's order of pairs.

        `plan` (a digest of the pairs' lengths, the batch settings and the seed) and `batches_per_epoch` (packed: of
        the first epoch) are included so that restoring into a stream over other data or other batch settings is
        caught.
        """
        return {
            "epoch": self._epoch,
            "index": self._index,
            "position": self._position,
            "plan": self.plan_key,
            "batches_per_epoch": self.batches_per_epoch,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Moves to a position saved by `state()` (or by a stream before `position` and `plan` were kept: its
        batches are cut again up to the position, and its batches per epoch compared)."""
        try:
            epoch, index = state["epoch"], state["index"]
        except (KeyError, TypeError):
            raise ValueError(f"BatchStream.restore: expected a dict with 'epoch' and 'index', got {state!r}") from None
        position = state.get("position")
        for name, value in (("epoch", epoch), ("index", index), ("position", position or 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"BatchStream.restore: {name} must be an int >= 0, got {value!r}")
        plan = state.get("plan")
        if plan is None:  # saved before plans had a key: the batches per epoch tell whether the plan is the same
            saved = state.get("batches_per_epoch", self.batches_per_epoch)
            fits = saved == self.batches_per_epoch
        else:
            saved, fits = state.get("batches_per_epoch"), plan == self.plan_key
        self._epoch, self._index = epoch, index
        self._start_epoch(position if plan is not None else None)
        if not fits or self._next is None:
            raise ValueError(
                f"BatchStream.restore: the state (batch {index} of epoch {epoch}, {saved} batches per epoch) does "
                f"not fit this stream ({self.batches_per_epoch} batches per epoch); was it saved with other data, "
                f"max_tokens, batching, pack_length or row_multiple?"
            )
        if plan is not None and isinstance(self._batches, _Packing) and _is_count(saved):
            self._batches._batches_per_epoch = saved  # the same plan: its count need not be packed again

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


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _digest(value: Any) -> str:
    """A short digest of nested tuples of ints, strings and numpy arrays."""
    import hashlib

    digest = hashlib.sha256()

    def add(x: Any) -> None:
        if isinstance(x, np.ndarray):
            digest.update(f"array{x.dtype.str}{x.shape}".encode())
            digest.update(np.ascontiguousarray(x).tobytes())
        elif isinstance(x, (tuple, list)):
            digest.update(b"(")
            for item in x:
                add(item)
            digest.update(b")")
        else:
            digest.update(repr(x).encode())

    add(value)
    return digest.hexdigest()[:16]


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


@dataclasses.dataclass
class ValidationSet:
    """Validation data in the two forms evaluation needs: id batches for the loss, text for BLEU / chrF."""

    batches: list[dict[str, np.ndarray]]
    sources: list[str]
    references: list[str]
    languages: list[tuple[str, str]] | None = None  # each pair's (source, target) codes, for many language pairs

    @classmethod
    def from_encoded(
        cls, encoded: EncodedCorpus, corpus: Corpus, max_tokens: int, batching: str = "packed"
    ) -> ValidationSet:
        """`encoded` = encode_corpus(corpus, ...); pairs skipped as too long are left out of both forms. Packed
        (the default) gives every loss batch one shape, rows of the longest validation pair rounded up to 8, so the
        eval step compiles once."""
        batches = [batch for batch, _ in eval_batches(encoded, max_tokens, batching=batching)]
        return cls(
            batches,
            [corpus.sources[i] for i in encoded.corpus_index],
            [corpus.targets[i] for i in encoded.corpus_index],
            None if corpus.languages is None else [corpus.languages[i] for i in encoded.corpus_index],
        )
