"""Text in, text out: `translate` encodes sentences, decodes them in batches of a few fixed shapes (sorted by length,
so compilations are few and reused; `plan_translation`) with the rules the model decodes with (`DecodeConfig`, via
`decoding.decoder_for`), and decodes the tokens to text; `translate_lines` does it for a file or stream of any size,
chunk by chunk, one output line per input line. `compile_translation` compiles a plan's programs ahead."""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import os
import stat
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from jax_transformer import schedule as schedules
from jax_transformer.checks import TokenError
from jax_transformer.config import DecodeConfig, TransformerConfig
from jax_transformer.decoding import DEFAULT_MAX_LEN_A, DEFAULT_MAX_LEN_B, decoder_for, on_device
from jax_transformer.errors import DataError, WriteError
from jax_transformer.tokenizer import LanguageCodeTokenizer

TRANSLATE_BATCH_SIZE = 64  # sentences decoded together by `translate`
# Lines `translate_lines` reads, sorts by length and decodes at a time. More lines make batches of more alike
# lengths, and a chunk's last batch, which decodes with no other beside it, a smaller share (docs/benchmarks.md);
# the memory a chunk holds, and the wait for its first output line, grow with it.
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

    Fewer widths mean fewer compilations, but wider padding costs decoding time: every step attends over, and
    beam search reorders, a cache as long as the output limit, which grows with the width. Doubling widths kept
    both costs low on Multi30k (docs/training.md, "Batching and compilation")."""
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
    decode as 32 + 4 rows, not as 64 (28 of them filler). A batch of fewer than `schedules.SMALLEST_LEVEL` (4) rows
    counts as 4 here, a rough floor: a beam step costs about the same below, a greedy one at 1 row about half."""
    sizes = batch_buckets(batch_size)
    whole = _bucket(n, sizes)
    first = max(size for size in sizes if size <= n)
    if first == n:
        return [n]
    second = _bucket(n - first, sizes)
    floor = schedules.SMALLEST_LEVEL
    return [first, second] if max(first, floor) + max(second, floor) < whole else [whole]


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


@dataclasses.dataclass(frozen=True)
class TranslationPlan:
    """How `translate` decodes sources of these lengths: its batches (`translation_batches`), how many it decodes
    at the same time (each in a thread of its own), and how each runs (`schedule`)."""

    lengths: np.ndarray  # (N,) each source's length, EOS included
    batches: list[tuple[np.ndarray, int, int]]  # (sentence indices, rows, width)
    at_once: int
    schedule: schedules.Schedule

    def shapes(self) -> list[tuple[int, int]]:
        """The distinct (rows, width) of its batches."""
        return sorted({(rows, width) for _, rows, width in self.batches})

    def encoder_shapes(self) -> list[tuple[int, int, int]]:
        """The (rows, cut width, batch width) of every encoder program its batches run, filler rows included."""
        shapes = set()
        for chunk, rows, width in self.batches:
            row_lengths = np.zeros(rows, np.int64)
            row_lengths[: len(chunk)] = self.lengths[chunk]
            shapes |= self.schedule.encoder_shapes(row_lengths, width)
        return sorted(shapes)


def plan_translation(
    lengths: Sequence[int], batch_size: int, max_len: int, schedule: schedules.Schedule | None = None
) -> TranslationPlan:
    """The plan of `translate` for sources of these lengths (EOS included), on `schedule` (default:
    `schedule.default()`, which says how many whole batches to decode at once and how each then runs)."""
    batches = translation_batches(lengths, batch_size, max_len)
    at_once, schedule = (schedule or schedules.default()).for_batches(len(batches))
    return TranslationPlan(np.asarray(lengths, np.int64), batches, at_once, schedule)


def compile_translation(
    params,
    config: TransformerConfig,
    plan: TranslationPlan,
    *,
    beam_size: int,
    max_len_a: float = DEFAULT_MAX_LEN_A,
    max_len_b: float = DEFAULT_MAX_LEN_B,
    decode: DecodeConfig | None = None,
) -> dict[str, Callable[[], Any]]:
    """Compile jobs for every program `translate` runs for `plan` (the decoders of its batches' shapes, at every
    level and cache length their search goes through, and its encoders), by name: run them (e.g. with
    `compilation.CompileJobs`) and `translate` compiles none of them. Alpha is an argument of the programs, not a
    part of them: any value compiles the same."""
    jobs = {}
    for rows, width in plan.shapes():
        decoder = decoder_for(
            config, decode, width, beam_size=beam_size, alpha=0.6, max_len_a=max_len_a, max_len_b=max_len_b
        )
        name = f"{type(decoder.rules).__name__.lower()} {'greedy' if decoder.rules.greedy else f'beam {beam_size}'}"
        for program, job in decoder.programs(params, rows, width, plan.schedule).items():
            jobs[f"{name} {program}"] = job
    for (rows, cut, width), job in plan.schedule.encoder_programs(
        on_device(params), config, plan.encoder_shapes()
    ).items():
        jobs[f"encoder {rows}x{cut} of width {width}"] = job  # shared by the batches of that width
    return jobs


def forced_language(decode: DecodeConfig | None, tokenizer) -> DecodeConfig | None:
    """`decode` with the target language's code as the first output token, for a tokenizer that marks languages
    (`tokenizer.LanguageCodeTokenizer`, whose model decodes by transformers' rules); others as they are."""
    if not isinstance(tokenizer, LanguageCodeTokenizer):
        return decode
    return (decode or DecodeConfig(rules="transformers")).replace(forced_bos=tokenizer.forced_bos_id)


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
    batch padded to one of a few shapes (`plan_translation`), so compilations are few and reused; where the schedule
    says so (a CPU of two cores or more), several batches at once in threads of their own, which take the caller's
    matmul precision and default device. For a file or stream of any size, `translate_lines` does this chunk by
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
    decode = forced_language(decode, tokenizer)
    plan = plan_translation([len(s) for s in sources], batch_size, config.max_len)
    params = on_device(params)  # once for all the batches of a call (of a chunk, for translate_lines)
    settings = schedules.callers_settings()  # the caller's matmul precision and device, in the pool's threads too
    options = dict(beam_size=beam_size, alpha=alpha, max_len_a=max_len_a, max_len_b=max_len_b)

    def decode_batch(batch) -> np.ndarray:  # (rows, T) tokens of one batch
        chunk, rows, width = batch
        src = np.full((rows, width), config.pad_id, dtype=np.int32)  # filler rows stay all-PAD
        for row, i in enumerate(chunk):
            src[row, : len(sources[i])] = sources[i]
        with settings():
            return decoder_for(config, decode, width, **options)(params, src, plan.schedule)[0]

    out: list[str] = [""] * len(sources)
    bar = tqdm(total=len(plan.batches), desc="translate", unit="batch", disable=not progress or len(plan.batches) < 2)
    with bar, ThreadPoolExecutor(plan.at_once) as pool:
        # A batch at a time in this thread, or several at once in the pool's (jax releases the GIL as programs run).
        decoded = pool.map(decode_batch, plan.batches) if plan.at_once > 1 else map(decode_batch, plan.batches)
        try:
            for (chunk, _, _), tokens in zip(plan.batches, decoded):
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


class OutputLines:
    """`translate_lines`'s `write` into a file descriptor (stdout's): each line written whole with `os.write`
    before the next (Python's buffered writer can report a short write to a full disk as done), so that when the
    output fails (a full disk, a file-size limit) the lines it holds whole are known. The error names the output
    and that count, and a regular file is cut back to those lines: no partial line is left. A closed pipe
    (`translate | head`) is a BrokenPipeError, passed on for the caller to end quietly."""

    def __init__(self, fd: int, name: str = "stdout") -> None:
        self.fd, self.name, self.written = fd, name, 0
        info, self.end = os.fstat(fd), None  # end: where the last whole line ends in a regular file
        if stat.S_ISREG(info.st_mode):  # `>>` (O_APPEND) writes at the end, whatever the offset says
            appending = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND
            self.end = info.st_size if appending else os.lseek(fd, 0, os.SEEK_CUR)

    def __call__(self, text: str) -> None:
        line = text.encode("utf-8") + b"\n"
        left = memoryview(line)
        try:
            while left:
                left = left[os.write(self.fd, left) :]
        except BrokenPipeError:
            raise
        except OSError as e:
            if self.cut_back():
                kept = " (cut back to them)"
            else:
                kept = f", then {len(line) - len(left)} bytes of the next" if len(left) < len(line) else ""
            raise WriteError(
                f"cannot write to {self.name}: {e.strerror or e}; it holds the first {self.written} translations "
                f"whole{kept}"
            ) from None
        self.written += 1
        if self.end is not None:
            self.end += len(line)

    def cut_back(self) -> bool:
        """A regular file truncated to the lines written whole; False where that cannot be done (a pipe)."""
        if self.end is None:
            return False
        try:
            os.ftruncate(self.fd, self.end)
            return True
        except OSError:
            return False


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
