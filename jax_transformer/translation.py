"""Text in, text out: `translate` encodes sentences, decodes them in batches of a few fixed shapes (sorted by length,
so compilations are few and reused) with the rules the model decodes with (`DecodeConfig`: this project's search,
`jax_transformer.decoding`, or transformers' generate, `jax_transformer.generate`), and decodes the tokens to text;
`translate_lines` does it for a file or stream of any size, chunk by chunk, one output line per input line."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jax_transformer import generate
from jax_transformer.checks import TokenError
from jax_transformer.config import DecodeConfig, TransformerConfig
from jax_transformer.decoding import (
    DEFAULT_MAX_LEN_A,
    DEFAULT_MAX_LEN_B,
    SMALLEST_LEVEL,
    _beam_core,
    _greedy_core,
    beam_search,
    callers_settings,
    encoder_groups,
    encoder_jobs,
    encoder_shapes,
    greedy_search,
    on_device,
    output_length,
    parts,
    shrinking_programs,
    side_by_side,
)
from jax_transformer.errors import DataError

TRANSLATE_BATCH_SIZE = 64  # sentences decoded together by `translate`
# Lines `translate_lines` reads, sorts by length and decodes at a time. More lines make batches of more alike
# lengths, and a chunk's last batch, which decodes with no other beside it, a smaller share: on 5,000 Multi30k
# sentences (2-core EPYC) 4,096 lines a chunk were 3.6% faster than 1,024 greedy, 2.7% with beam 4. The memory
# a chunk holds, and the wait for its first output line, grow with it.
TRANSLATE_CHUNK_LINES = 4096


# =============================================================================================================
# Translating sentences
# =============================================================================================================


def batch_buckets(batch_size: int) -> tuple[int, ...]:
    """Row counts a decoding batch is padded to: 1, 2, 4, ... (powers of two below batch_size), batch_size."""
    sizes = [1]
    while sizes[-1] * 2 < batch_size:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes) + ((batch_size,) if batch_size > 1 else ())


def decode_widths(max_len: int) -> tuple[int, ...]:
    """Source widths a decoding batch is padded to: 16, 32, 64, ... (powers of two below max_len), then max_len.

    Fewer widths mean fewer compilations (a decoder takes seconds to compile on a CPU, tens on a GPU), but wider
    padding costs decoding time: every step attends over, and beam search reorders, a cache as long as the output
    limit, which grows with the width. Measured on Multi30k's validation set (small preset, beam 4, CPU, under
    load): widths 16/32/64 decode 7-15% slower than the data buckets' 16/24/32/56 and need 3 decoders instead of
    4; 32/64 need 2 but decode 19-68% slower, more than the compilation they save."""
    widths, width = [], 16
    while width < max_len:
        widths.append(width)
        width *= 2
    return tuple(widths) + (max_len,)


def _bucket(n: int, sizes: Sequence[int]) -> int:
    return next(size for size in sizes if size >= n)


def _tail_rows(n: int, batch_size: int) -> list[int]:
    """Row counts for the last n < batch_size sentences: one batch of the next power of two, or two whose rows add
    up to fewer: the largest power of two below n, and one for the rest. A step costs about its rows' share of
    the work down to a few rows, and filler rows decode like real ones until the batch shrinks: 36 sentences
    decode as 32 + 4 rows, not as 64 (28 of them filler). A batch of fewer than `SMALLEST_LEVEL` (4) rows counts
    as 4 here, a rough floor: a beam step costs about the same below, a greedy one at 1 row about half."""
    sizes = batch_buckets(batch_size)
    whole = _bucket(n, sizes)
    first = max(size for size in sizes if size <= n)
    if first == n:
        return [n]
    second = _bucket(n - first, sizes)
    return [first, second] if max(first, SMALLEST_LEVEL) + max(second, SMALLEST_LEVEL) < whole else [whole]


def translation_batches(lengths: Sequence[int], batch_size: int, max_len: int) -> list[tuple[np.ndarray, int, int]]:
    """How `translate` batches sources of these lengths (EOS included): (sentence indices, rows, width) per batch.

    Sentences are sorted by length (similar lengths share a batch) and taken `batch_size` at a time. The last
    ones, fewer than `batch_size`, go in one or two batches of a power of two rows (`_tail_rows`), completed with
    all-PAD filler rows, which finish at once. The width is the first of `decode_widths(max_len)` that holds the
    longest source of the batch."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    order = np.argsort(np.asarray(lengths, dtype=np.int64), kind="stable")
    whole, rest = divmod(len(order), batch_size)
    rows = [batch_size] * whole + (_tail_rows(rest, batch_size) if rest else [])
    widths = decode_widths(max_len)
    batches, start = [], 0
    for n in rows:
        chunk = order[start : start + n]
        start += len(chunk)
        batches.append((chunk, n, _bucket(max(int(lengths[i]) for i in chunk), widths)))
    return batches


def batches_at_once(n_batches: int) -> int:
    """How many of its `n_batches` batches `translate` decodes at the same time, each whole in a thread of its own:
    `decoding.side_by_side()` (2 on a CPU of two cores or more, 1 elsewhere), when it has that many batches or
    more; else 1, a batch at a time, which the searches may cut in parts (`decoding.parts`: on a CPU of two cores
    or more, a batch of 8 sentences or more decodes as two halves side by side). Whole batches side by side
    beat one batch at a time in halves: each core multiplies matrices of twice the rows, and one that finishes
    goes on with the next batch instead of waiting for the other half (100 and 1,000 Multi30k sentences on a
    2-core EPYC: 14-18% more sentences/s greedy, 3-18% with beam 4; docs/benchmarks.md)."""
    threads = side_by_side()
    return threads if n_batches >= threads else 1


def translation_shapes(lengths: Sequence[int], batch_size: int, max_len: int) -> list[tuple[int, int, bool]]:
    """The distinct (rows, width, split) shapes `translate` decodes sources of these lengths in: split, whether it
    lets the search cut a batch in parts (`batches_at_once`; `decoding.parts` decides how many). Each shape compiles
    one program per level its batch can shrink to, and its encoder a program per group shape and width
    (`compile_translation`)."""
    batches = translation_batches(lengths, batch_size, max_len)
    split = batches_at_once(len(batches)) == 1
    return sorted({(rows, width, split) for _, rows, width in batches})


def translation_encoders(lengths: Sequence[int], batch_size: int, max_len: int) -> list[tuple[int, int, int]]:
    """The (rows, cut width, batch width) of every encoder program `translate` runs on sources of these lengths
    (EOS included): each batch's rows (its filler rows of length 0 among them), in the parts the search cuts it
    into (`decoding.parts`), grouped as `decoding.encoder_groups` groups them. For `compile_translation`'s
    `encoders`: fewer programs than every group shape the batches' shapes allow."""
    batches = translation_batches(lengths, batch_size, max_len)
    split = batches_at_once(len(batches)) == 1
    shapes = set()
    for chunk, rows, width in batches:
        row_lengths = np.zeros(rows, np.int64)
        row_lengths[: len(chunk)] = np.asarray(lengths, np.int64)[chunk]
        n = parts(rows, split)
        for i in range(n):  # part i takes rows i, i + n, ... (decoding.decode_shrinking)
            shapes.update((len(group), cut, width) for group, cut in encoder_groups(row_lengths[i::n], width))
    return sorted(shapes)


def compile_translation(
    params,
    config: TransformerConfig,
    shapes: Sequence[tuple[int, int, bool]],
    *,
    beam_size: int,
    max_len_a: float = DEFAULT_MAX_LEN_A,
    max_len_b: float = DEFAULT_MAX_LEN_B,
    decode: DecodeConfig | None = None,
    encoders: Sequence[tuple[int, int, int]] | None = None,
) -> dict[str, Any]:
    """Compile jobs for the decoder `translate` uses on batches of these (rows, width, split) shapes (split: the
    searches' `split`, as `translation_shapes` gives it; True for a search called with its defaults): {name: a
    function that compiles it}, one per level a batch shrinks through as its sentences finish
    (`decoding.shrink_levels`), and one per shape its encoder runs at (`decoding.encode_batch`): those of
    `encoders`, (rows, cut width, batch width) as `translation_encoders` gives them for the sentences to come, or
    where it is None every one the batches' shapes allow.
    Run them (e.g. with `compilation.CompileJobs`) before decoding and `translate` compiles none of its searches
    and encoders (the small gathers between them compile on first use): `compile_ahead` fills the cache its calls
    look in (alpha is an array argument, any value)."""
    jobs = {}
    for rows, width, split in shapes:
        if decode is not None and decode.rules == "transformers":
            name, levels = (
                f"generate {beam_size}",
                generate.compile_generate(params, config, rows, width, beam_size, decode, split),
            )
        else:
            name, levels = _compile_search(params, config, rows, width, beam_size, max_len_a, max_len_b, split)
        # A level below the first (the rows of a part of the batch: decoding.parts), or a longer cache, goes on
        # from a carried state: another program than a fresh batch of that many rows.
        fresh = (max(n for n, _ in levels), min(end for _, end in levels))
        for (n, end), job in levels.items():
            jobs[f"{name} {n}x{width} cache {end}" + ("" if (n, end) == fresh else " resumed")] = job
    if encoders is None:  # every group shape the batches' parts may meet, whatever their lengths
        encoders = sorted(
            {
                (n, cut, width)
                for rows, width, split in shapes
                for n, cut in encoder_shapes(rows // parts(rows, split), width)
            }
        )
    for (n, cut, width), job in encoder_jobs(params, config, encoders).items():
        jobs[f"encoder {n}x{cut} of width {width}"] = job  # shared by the batches of that width
    return jobs


def _compile_search(
    params, config: TransformerConfig, rows: int, width: int, beam_size: int, max_len_a, max_len_b, split: bool
):
    """(name, compile jobs by level) of this project's greedy or beam search on (rows, width) sources."""
    length = output_length(width, config, max_len_a, max_len_b)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)

    def per_row(n: int) -> tuple:
        return jax.ShapeDtypeStruct((n, width), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.int32)  # src, max_new

    if beam_size == 1:
        return "greedy search", shrinking_programs(
            _greedy_core, params, rows, per_row, (scalar,), dict(config=config, length=length), length, split=split
        )
    penalties = jax.ShapeDtypeStruct((length + 1,), jnp.float32)
    static = dict(config=config, length=length, beam_size=int(beam_size))
    return f"beam search {beam_size}", shrinking_programs(
        _beam_core, params, rows, per_row, (scalar, penalties), static, length, int(beam_size), split=split
    )


def encode_sources(tokenizer, sentences: Sequence[str], config: TransformerConfig) -> list[np.ndarray]:
    """Subword ids + [EOS] of each sentence (the encoder-input convention of `jax_transformer.data`); a sentence
    longer than the model allows is a TokenError naming it (`translate_lines` has the rule for files)."""
    if isinstance(sentences, str):
        raise TypeError("translate takes a list of sentences, got one str")
    encoded = []
    for i, ids in enumerate(tokenizer.encode_batch(list(sentences))):
        if len(ids) + 1 > config.max_len:
            raise TokenError(
                f"sentence {i} has {len(ids)} tokens + EOS, more than config.max_len="
                f"{config.max_len}: {sentences[i][:60]!r}"
            )
        encoded.append(np.array(list(ids) + [config.eos_id], dtype=np.int32))
    return encoded


def translate(
    params,
    config: TransformerConfig,
    tokenizer,
    sentences: Sequence[str],
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    batch_size: int = TRANSLATE_BATCH_SIZE,
    max_len_a: float = DEFAULT_MAX_LEN_A,
    max_len_b: float = DEFAULT_MAX_LEN_B,
    progress: bool = True,
    decode: DecodeConfig | None = None,
) -> list[str]:
    """Translates sentences (strings) and returns the translations in the same order.

    beam_size=1 uses greedy search, larger values beam search with length penalty `alpha`, by the rules of
    `decode` (default: this project's). Sentences are sorted by length and decoded `batch_size` at a time, each
    batch padded to one of a few shapes (`translation_batches`), so compilations are few and reused; on a CPU of
    two cores or more, two batches at once in threads of their own, which take the caller's matmul precision and
    default device (`batches_at_once`). For a file or stream of any size, `translate_lines` does this chunk by
    chunk.
    """
    sources = encode_sources(tokenizer, sentences, config)
    options = dict(beam_size=beam_size, alpha=alpha, batch_size=batch_size, max_len_a=max_len_a, max_len_b=max_len_b)
    return _translate_sources(params, config, tokenizer, sources, progress=progress, decode=decode, **options)


def _translate_sources(
    params,
    config: TransformerConfig,
    tokenizer,
    sources: list[np.ndarray],
    *,
    beam_size: int,
    alpha: float,
    batch_size: int,
    max_len_a: float,
    max_len_b: float,
    progress: bool,
    decode: DecodeConfig | None = None,
) -> list[str]:
    """Decoded text of encoded sources (ids + EOS), in their order; see `translate`."""
    batches = translation_batches([len(s) for s in sources], batch_size, config.max_len)
    params = on_device(params)  # once for all the batches of a call (of a chunk, for translate_lines)
    threads = batches_at_once(len(batches))  # each whole, side by side; or one at a time, which may be cut in parts
    options, settings = dict(split=threads == 1), callers_settings()

    def decode_batch(batch) -> np.ndarray:  # (rows, T) tokens of one batch
        chunk, rows, width = batch
        src = np.full((rows, width), config.pad_id, dtype=np.int32)  # filler rows stay all-PAD
        for row, i in enumerate(chunk):
            src[row, : len(sources[i])] = sources[i]
        with settings():
            if decode is not None and decode.rules == "transformers":
                return generate.generate_as(
                    params, config, src, decode, num_beams=beam_size, length_penalty=alpha, **options
                )
            limits = dict(max_len_a=max_len_a, max_len_b=max_len_b, **options)
            if beam_size == 1:
                return greedy_search(params, config, src, **limits)[0]
            return beam_search(params, config, src, beam_size=beam_size, alpha=alpha, **limits)[0]

    out: list[str] = [""] * len(sources)
    bar = tqdm(total=len(batches), desc="translate", unit="batch", disable=not progress or len(batches) < 2)
    with bar, ThreadPoolExecutor(threads) as pool:
        # A batch at a time in this thread, or `threads` at once in the pool's (jax releases the GIL as programs run).
        decoded = pool.map(decode_batch, batches) if threads > 1 else map(decode_batch, batches)
        try:
            for (chunk, _, _), tokens in zip(batches, decoded):
                for row, i in enumerate(chunk):
                    out[i] = tokenizer.decode(tokens[row])
                bar.update()
        finally:  # on an error (or Ctrl-C) here, the batches not yet started are dropped, not decoded first
            pool.shutdown(cancel_futures=True)
    return out


# =============================================================================================================
# Translating a file or stream of any size
# =============================================================================================================

ON_TOO_LONG = ("error", "truncate")


@dataclasses.dataclass
class TranslationReport:
    """What `translate_lines` did: lines read, of which empty (passed through) and truncated (first few kept)."""

    lines: int = 0
    empty: int = 0
    truncated: int = 0
    truncated_lines: list[int] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        text = f"translated {self.lines - self.empty} lines ({self.lines} read, {self.empty} empty)"
        if self.truncated:
            shown = ", ".join(map(str, self.truncated_lines)) + (", ..." if self.truncated > 10 else "")
            text += f"; {self.truncated} truncated to the model's max_len (lines {shown})"
        return text


def translate_lines(
    params,
    config: TransformerConfig,
    tokenizer,
    lines: Iterable[str],
    write: Callable[[str], None],
    *,
    origin: str = "input",
    on_too_long: str = "error",
    chunk_size: int = TRANSLATE_CHUNK_LINES,
    total: int | None = None,
    progress: bool | None = True,
    beam_size: int = 4,
    alpha: float = 0.6,
    batch_size: int = 64,
    max_len_a: float = DEFAULT_MAX_LEN_A,
    max_len_b: float = DEFAULT_MAX_LEN_B,
    decode: DecodeConfig | None = None,
) -> TranslationReport:
    """Translates `lines` (any iterable of strings, e.g. a file read lazily) and calls `write(translation)` once
    per input line, in order: exactly one output per input, an empty (or blank) line gives an empty output, and
    line breaks inside a translation become spaces. Memory is bounded by `chunk_size` lines: each chunk is read,
    decoded (sorted by length into batches, as `translate` does) and written before the next is read.

    The too-long rule: a line of n tokens needs n + 1 <= config.max_len positions (EOS). With on_too_long="error"
    a longer line is a DataError naming `origin` and the line (the lines before it are already written); with
    "truncate" its first max_len - 1 tokens are translated, and the report counts and names the lines.
    beam_size, alpha, batch_size, max_len_a, max_len_b: as for `translate`. `progress`: a tqdm bar on stderr
    counting lines (`total` lines if known; None: only when stderr is a terminal).
    """
    if on_too_long not in ON_TOO_LONG:
        raise ValueError(f"on_too_long must be one of {ON_TOO_LONG}, got {on_too_long!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    options = dict(beam_size=beam_size, alpha=alpha, batch_size=batch_size, max_len_a=max_len_a, max_len_b=max_len_b)
    options["decode"] = decode
    report = TranslationReport()
    bar = tqdm(
        total=total,
        desc="translate",
        unit="line",
        disable=None if progress is None else not progress,
        dynamic_ncols=True,
    )
    try:
        iterator = iter(lines)
        while chunk := list(itertools.islice(iterator, chunk_size)):
            first = report.lines + 1  # the 1-based number of the chunk's first line
            # Token ids of the non-empty lines, by index in the chunk; empty (or blank) lines stay empty.
            todo = [i for i, line in enumerate(chunk) if line.strip()]
            ids = dict(zip(todo, tokenizer.encode_batch([chunk[i] for i in todo])))
            too_long = None
            if on_too_long == "error":  # translate and write the lines before the first too-long one, then stop
                too_long = next((i for i in todo if len(ids[i]) > config.max_len - 1), None)
                if too_long is not None:
                    n_tokens = len(ids[too_long])
                    chunk, ids = chunk[:too_long], {i: v for i, v in ids.items() if i < too_long}
            sources = [_apply_length_rule(ids[i], config, report, first + i) for i in sorted(ids)]
            translations = iter(_translate_sources(params, config, tokenizer, sources, progress=False, **options))
            for i in range(len(chunk)):
                # One output line per input line: line breaks inside a translation become spaces.
                write(next(translations).replace("\r", " ").replace("\n", " ") if i in ids else "")
            report.lines += len(chunk)
            report.empty += len(chunk) - len(ids)
            bar.update(len(chunk))
            if too_long is not None:
                limit = config.max_len - 1
                raise DataError(
                    f"{origin}, line {first + too_long}: {n_tokens} tokens, more than the model takes ({limit}: "
                    f"max_len={config.max_len} positions, one for EOS); the {report.lines} lines before it are "
                    f"translated; pass --on-too-long truncate to translate the first {limit} tokens of such lines"
                )
    finally:
        bar.close()
    return report


def _apply_length_rule(ids, config: TransformerConfig, report: TranslationReport, line: int) -> np.ndarray:
    """ids + EOS of one line, its first max_len - 1 tokens when longer (counted in the report)."""
    limit = config.max_len - 1  # positions for tokens; one is left for EOS
    if len(ids) > limit:
        report.truncated += 1
        if len(report.truncated_lines) < 10:
            report.truncated_lines.append(line)
        ids = ids[:limit]
    return np.array(list(ids) + [config.eos_id], dtype=np.int32)
