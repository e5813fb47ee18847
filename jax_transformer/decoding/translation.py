"""Text in, text out: `translations` encodes sentences (and their target prefixes), decodes them in batches of a few
fixed shapes (sorted by length, so compilations are few and reused; of a sentence count or a token budget, over the
'data' axis of the weights' mesh where they lie on one; `plan_translation`) as one `DecodeConfig` says
(`decoding.decoder`), and returns each sentence's hypotheses with their text, tokens and scores; `translate` the
best texts alone. `translate_lines` does it for a file or stream of any size, chunk by chunk, one output record per
input line (text, TSV or JSON lines: `format_translation`). `compile_translation` compiles a plan's programs
ahead."""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import json
import os
import stat
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from jax_transformer.data.tokenizer import UNK_ID, LanguageCodeTokenizer, Tokenizer
from jax_transformer.decoding import alignment
from jax_transformer.decoding import schedule as schedules
from jax_transformer.decoding.decoders import Decoded, decoder, on_device
from jax_transformer.decoding.glossary import Glossary
from jax_transformer.errors import DataError, TokenError, UsageError, WriteError
from jax_transformer.settings.config import DecodeConfig, TransformerConfig

TRANSLATE_BATCH_SIZE = 64  # sentences decoded together by `translate`
# Lines `translate_lines` reads, sorts by length and decodes at a time. More lines make batches of more alike
# lengths, and a chunk's last batch, which decodes with no other beside it, a smaller share (docs/benchmarks.md);
# the memory a chunk holds, and the wait for its first output line, grow with it.
TRANSLATE_CHUNK_LINES = 4096


# =============================================================================================================
# Translating sentences
# =============================================================================================================


def batch_buckets(batch_size: int, multiple: int = 1) -> tuple[int, ...]:
    """Row counts a decoding batch is padded to: 1, 2, 4, ... (powers of two below batch_size), batch_size; each
    times `multiple` (the devices a batch's rows are split over), batch_size rounded up to a multiple of it."""
    top = -(-batch_size // multiple)  # batch_size in units of `multiple`
    sizes = [1]
    while sizes[-1] * 2 < top:
        sizes.append(sizes[-1] * 2)
    return tuple(multiple * n for n in sizes + ([top] if top > 1 else []))


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


def _tail_rows(n: int, sizes: Sequence[int]) -> list[int]:
    """Row counts for the last n sentences (n <= sizes[-1]): one batch of the next row bucket of `sizes`, or two
    whose rows add up to fewer: the largest bucket below n, and one for the rest. A step costs about its rows' share
    of the work down to a few rows, and filler rows decode like real ones until the batch shrinks: 36 sentences
    decode as 32 + 4 rows, not as 64 (28 of them filler). A batch of fewer than `schedules.SMALLEST_LEVEL` (4) rows
    counts as 4 here, a rough floor: a beam step costs about the same below, a greedy one at 1 row about half."""
    whole = _bucket(n, sizes)
    below = [size for size in sizes if size < n]
    if whole == n or not below:
        return [whole]
    first = below[-1]
    second = _bucket(n - first, sizes)
    floor = schedules.SMALLEST_LEVEL
    return [first, second] if max(first, floor) + max(second, floor) < whole else [whole]


def _budget_rows(lengths: np.ndarray, max_tokens: int, sizes: Sequence[int], widths: Sequence[int]) -> list[int]:
    """The rows of each batch of sources sorted by length (`lengths`, ascending) under a budget of `max_tokens`
    slots (rows x padded width): each batch takes sentences while its padded shape fits, is cut back to a whole
    row bucket (the rest begin the next batch, which may be wider), and the last ones go as `_tail_rows` says."""

    def fits(count: int, width: int) -> bool:
        return count <= sizes[-1] and _bucket(count, sizes) * width <= max_tokens

    rows, start, n = [], 0, len(lengths)
    while start < n:
        # The smallest batch (sizes[0] rows: one sentence, or one per data device) is filled whatever the budget:
        # a sentence too long for the budget is still decoded, in the smallest batch that can hold it.
        end = min(start + sizes[0], n)
        while end < n and fits(end + 1 - start, _bucket(int(lengths[end]), widths)):
            end += 1
        if end == n:
            return rows + _tail_rows(end - start, sizes)
        # Cut back to a whole bucket (as fairseq cuts a batch to a multiple of --required-batch-size-multiple): no
        # filler rows before the last batch; the rest begin the next one.
        rows.append(max(size for size in sizes if size <= end - start))
        start += rows[-1]
    return rows


def check_batching(batch_size: int | None, max_tokens: int | None, row_multiple: int = 1) -> None:
    """ValueError naming the argument unless each given one is an int >= 1, and at most one of batch_size and
    max_tokens is given."""
    if max_tokens is not None and batch_size is not None:
        raise ValueError(f"give batch_size ({batch_size}) or max_tokens ({max_tokens}), not both")
    for name, value in (("batch_size", batch_size), ("max_tokens", max_tokens), ("row_multiple", row_multiple)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def translation_batches(
    lengths: Sequence[int],
    batch_size: int | None,
    max_len: int,
    *,
    max_tokens: int | None = None,
    row_multiple: int = 1,
) -> list[tuple[np.ndarray, int, int]]:
    """How `translate` batches sources of these lengths (EOS included): (sentence indices, rows, width) per batch.

    Sentences are sorted by length (similar lengths share a batch). By default they are taken `batch_size` at a
    time (None: TRANSLATE_BATCH_SIZE), the last ones, fewer, in one or two smaller batches (`_tail_rows`). With
    `max_tokens` instead, each batch takes as many as fit rows x padded width <= max_tokens (`_budget_rows`). A
    batch's rows are one of a few buckets (`batch_buckets`: powers of two times `row_multiple`, the devices its rows
    are split over), completed with all-PAD filler rows, which finish at once; its width is the first of
    `decode_widths(max_len)` that holds its longest source. So a corpus compiles a handful of shapes.

    The budget, as fairseq's --max-tokens and CTranslate2's max_batch_size with batch_type="tokens" count it: the
    padded shape (rows x width), not the sum of lengths. Unlike fairseq, which refuses a sentence longer than the
    budget, and like CTranslate2, which gives it a batch of its own, a batch is never smaller than its smallest
    bucket (`row_multiple` rows): only such a batch may exceed the budget, where one of its sentences alone does."""
    check_batching(batch_size, max_tokens, row_multiple)
    order = np.argsort(np.asarray(lengths, dtype=np.int64), kind="stable")
    widths = decode_widths(max_len)
    if max_tokens is None:
        sizes = batch_buckets(TRANSLATE_BATCH_SIZE if batch_size is None else batch_size, row_multiple)
        whole, rest = divmod(len(order), sizes[-1])
        rows = [sizes[-1]] * whole + (_tail_rows(rest, sizes) if rest else [])
    else:
        most = row_multiple  # the largest bucket whose rows fit the budget at the narrowest width, at least one
        while 2 * most * widths[0] <= max_tokens:
            most *= 2
        sorted_lengths = np.asarray(lengths, dtype=np.int64)[order]
        rows = _budget_rows(sorted_lengths, max_tokens, batch_buckets(most, row_multiple), widths)
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
    lengths: Sequence[int],
    batch_size: int | None,
    max_len: int,
    schedule: schedules.Schedule | None = None,
    *,
    max_tokens: int | None = None,
    row_multiple: int = 1,
) -> TranslationPlan:
    """The plan of `translate` for sources of these lengths (EOS included), batched as `translation_batches` says,
    on `schedule` (default: `schedule.default()`, which says how many whole batches to decode at once and how each
    then runs)."""
    batches = translation_batches(lengths, batch_size, max_len, max_tokens=max_tokens, row_multiple=row_multiple)
    at_once, schedule = (schedule or schedules.default()).for_batches(len(batches))
    return TranslationPlan(np.asarray(lengths, np.int64), batches, at_once, schedule)


def weights_mesh(params) -> Mesh | None:
    """The mesh of several devices the weights lie on (`inference.load(mesh=...)`: one with a 'data' axis, as
    `sharding.MESH_AXES` names them), else None."""
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1 and "data" in sharding.mesh.axis_names:
            return sharding.mesh
    return None


@dataclasses.dataclass(frozen=True)
class OverData(schedules.Whole):
    """How a batch runs where the weights lie on a mesh: `Whole`, the batch as one program, its rows (a multiple of
    the 'data' axis's size, `translation_batches`' row_multiple) split over the 'data' axis of the weights' mesh.
    The sources and each row's settings are placed by rows; jit's partitioner lays out the rest (the encoder's
    output, the search's state) from them and the weights. Not the CPU's `Scheduled`: its halves, shrinking levels
    and encoder groups pick rows by index on the host, which gathers a split batch back and leaves row counts that
    the axis does not divide; nor batches side by side (`for_batches`: one at a time, each over every device)."""

    mesh: Mesh

    def decode(self, params, config, rules, src, rows, length):
        by_rows = NamedSharding(self.mesh, PartitionSpec("data"))  # dimension 0 (rows) over 'data', whole elsewhere
        src, rows = jax.device_put((src, rows), by_rows)
        return super().decode(params, config, rules, src, rows, length)

    def programs(self, params, config, rules, rows, width, length, phrases=None):
        return {}  # `Whole`'s would compile for one device: the mesh's programs compile at their first call

    def encoder_programs(self, params, config, shapes):
        return {}


def compile_translation(
    params, config: TransformerConfig, plan: TranslationPlan, decode: DecodeConfig | None = None
) -> dict[str, Callable[[], Any]]:
    """Compile jobs for every program `translate` runs for `plan` with `decode` (the decoders of its batches'
    shapes, at every level and cache length their search goes through, and its encoders), by name: run them (e.g.
    with `compilation.CompileJobs`) and `translate` compiles none of them. Alpha, the sampling settings and the seed
    are arguments of the programs, not parts of them: any value compiles the same."""
    decode = decode or DecodeConfig()
    jobs = {}
    for rows, width in plan.shapes():
        found = decoder(config, decode, width)
        how = "sample" if decode.do_sample else "greedy" if found.rules.greedy else f"beam {decode.beam_size}"
        name = f"{type(found.rules).__name__.lower()} {how}"
        for program, job in found.programs(params, rows, width, plan.schedule).items():
            jobs[f"{name} {program}"] = job
    for (rows, cut, width), job in plan.schedule.encoder_programs(
        on_device(params), config, plan.encoder_shapes()
    ).items():
        jobs[f"encoder {rows}x{cut} of width {width}"] = job  # shared by the batches of that width
    return jobs


def budget_shapes(max_tokens: int, max_len: int, row_multiple: int = 1) -> list[tuple[int, int]]:
    """Every (rows, width) that `translation_batches` may give under a budget of `max_tokens` (rows x width), for
    sources of any lengths: each row bucket at each width whose shape fits the budget, and the smallest bucket at
    every width (a long sentence is decoded whatever the budget)."""
    widths = decode_widths(max_len)
    most = row_multiple  # as translation_batches finds it
    while 2 * most * widths[0] <= max_tokens:
        most *= 2
    sizes = batch_buckets(most, row_multiple)
    return [(rows, width) for width in widths for rows in sizes if rows == sizes[0] or rows * width <= max_tokens]


def compile_every_shape(
    params,
    config: TransformerConfig,
    decode: DecodeConfig,
    shapes: Sequence[tuple[int, int]],
    schedule: schedules.Schedule,
) -> dict[str, Callable[[], Any]]:
    """Compile jobs for every program `decode` may run on batches of these (rows, width) shapes on `schedule`,
    whatever the sources' lengths (`Schedule.every_program`), by name: after them, decoding such batches compiles
    nothing. Names are unique over decodings that share programs, so that jobs of several decodings can be merged
    and each program compiled once."""
    params = on_device(params)
    jobs = {}
    for rows, width in shapes:
        found = decoder(config, decode, width)
        key = f"{jax.tree.structure(found.rules)} {found.length} x{found.samples}"
        for name, job in schedule.every_program(
            params, config, found.rules, rows * found.samples, width, found.length
        ).items():
            jobs[f"{key}: {name}" if not name.startswith("encoder") else name] = job
        if found.phrase_size is not None and not found.rules.greedy and found.rules.sampler is None:
            P, M = found.phrase_size  # the constrained programs of the one padded size its rows take
            for name, job in schedule.every_program(
                params, config, found.rules, rows, width, found.length, found.phrase_size
            ).items():
                jobs[f"{key} constrained {P}x{M}: {name}" if not name.startswith("encoder") else name] = job
    return jobs


def forced_language(decode: DecodeConfig | None, tokenizer) -> DecodeConfig:
    """`decode` (None: the default) with the target language's code as the first output token, for a tokenizer
    that marks languages (`tokenizer.LanguageCodeTokenizer`, whose model decodes by transformers' rules)."""
    from jax_transformer.settings.resolve import forced_language as forced

    return forced(decode, tokenizer.forced_bos_id if isinstance(tokenizer, LanguageCodeTokenizer) else None)


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


def encode_prefixes(tokenizer, prefixes: Sequence[str | None]) -> list[list[int] | None]:
    """The target prefix of each sentence as ids (None or "": none): its text encoded as targets are (after the
    target language's code, for a model that begins with it)."""
    texts = [p if p else "" for p in prefixes]
    encoded = tokenizer.encode_batch(texts, side="target") if any(texts) else [[] for _ in texts]
    return [list(ids) if text else None for text, ids in zip(texts, encoded)]


def encode_phrase(tokenizer, text: str) -> list[int]:
    """A constraint's ids: its text tokenized as target text in the middle of a sentence is (a SentencePiece
    model marks its first word's start), without EOS or a language code."""
    if hasattr(tokenizer, "pieces_ids"):  # a tokenizer that puts the language's code first
        return list(tokenizer.pieces_ids(text))
    return list(tokenizer.encode(text, side="target"))


def encode_constraints(
    tokenizer,
    config: TransformerConfig,
    decode: DecodeConfig,
    sources: Sequence[np.ndarray],
    prefixes: Sequence[list[int] | None] | None,
    constraints: Sequence[Sequence[str] | None] | None,
    names: Sequence[str],
) -> list[list[list[int]] | None] | None:
    """Each sentence's phrases (text) as ids, checked before anything is decoded: a DataError naming the sentence
    (`names`) for an empty phrase, one of characters the target vocabulary does not know, and what
    `Decoder.check_phrases` refuses (beam search only, at most a phrase per beam, their tokens within the
    sentence's length limit after its prefix). None where no sentence has any."""
    if constraints is None or not any(constraints):
        return None
    unk = getattr(tokenizer, "unk_id", UNK_ID if isinstance(tokenizer, Tokenizer) else None)
    found = decoder(config, decode, config.max_len)  # a row's limit depends on its source alone
    out = []
    for i, (texts, name) in enumerate(zip(constraints, names)):
        if not texts:
            out.append(None)
            continue
        if isinstance(texts, str):
            raise DataError(f"{name}: constraints must be a list of phrases, got one string {texts!r}")
        ids = []
        for n, text in enumerate(texts, 1):
            if not isinstance(text, str) or not text.strip():
                raise DataError(f"{name}: constraint {n} is empty ({text!r}): give the phrase the output must hold")
            ids.append(encode_phrase(tokenizer, text))
            if not ids[-1] or (unk is not None and unk in ids[-1]):
                raise DataError(
                    f"{name}: constraint {n} ({text!r}) has characters the target vocabulary does not know: no "
                    f"output could hold it"
                )
        limit = int(found.limits(np.asarray(sources[i], np.int32)[None])[0])
        room = limit - len(prefixes[i] or []) if prefixes is not None else limit
        try:
            found.check_phrases([ids], [room], [name])
        except TokenError as e:
            raise DataError(str(e)) from None
        out.append(ids)
    return out


def encode_suppressed(tokenizer, config: TransformerConfig, decode: DecodeConfig) -> list[list[int]] | None:
    """`decode.suppress`'s phrases as ids (None: none); a DataError for an empty or unknown one."""
    texts = [t for t in decode.suppress.split("|")] if decode.suppress else []
    if not texts:
        return None
    ids = []
    for n, text in enumerate(texts, 1):
        phrase = encode_phrase(tokenizer, text) if text.strip() else []
        if not phrase:
            raise DataError(f"--suppress: phrase {n} is empty (phrases are separated by |)")
        ids.append(phrase)
    try:
        decoder(config, decode, config.max_len).check_phrases([ids], None, ["--suppress"], must_appear=False)
    except TokenError as e:
        raise DataError(str(e)) from None
    return ids


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """One translation of a sentence: its text, its token ids (the prefix's first, EOS and padding left out), its
    score by the decoding's rules, and each token's log-prob (0 for a prefix's); with --alignments, its word
    alignment to the source ("0-0 1-2 ...": `alignment.sentence_alignment`), else None."""

    text: str
    tokens: list[int]
    score: float
    token_scores: list[float]
    alignment: str | None = None


@dataclasses.dataclass(frozen=True)
class Translation:
    """A sentence's translations, best first (`n_best` of them; fewer where the search found fewer)."""

    source: str
    hypotheses: list[Hypothesis]
    prefix: str | None = None

    @property
    def text(self) -> str:
        return self.hypotheses[0].text if self.hypotheses else ""


def translate(
    params,
    config: TransformerConfig,
    tokenizer,
    sentences: Sequence[str],
    decode: DecodeConfig | None = None,
    *,
    prefixes: Sequence[str | None] | None = None,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    progress: bool = True,
    constraints: Sequence[Sequence[str] | None] | None = None,
) -> list[str]:
    """The best translation of each sentence (strings), in the same order; `translations` has every hypothesis
    with its tokens and scores, and the arguments."""
    found = translations(params, config, tokenizer, sentences, decode, prefixes=prefixes, batch_size=batch_size,
                         max_tokens=max_tokens, progress=progress, constraints=constraints)  # fmt: skip
    return [t.text for t in found]


def translations(
    params,
    config: TransformerConfig,
    tokenizer,
    sentences: Sequence[str],
    decode: DecodeConfig | None = None,
    *,
    prefixes: Sequence[str | None] | None = None,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    progress: bool = True,
    schedule: schedules.Schedule | None = None,
    encoded: Sequence[np.ndarray] | None = None,
    constraints: Sequence[Sequence[str] | None] | None = None,
) -> list[Translation]:
    """Translates sentences (strings) as `decode` says (default: `DecodeConfig()`, this project's beam search of 4;
    the n-best list, sampling and the rules are its fields), each from its target prefix if `prefixes` gives one
    (text the translation must begin with; None or "": none). Returns a `Translation` per sentence, in order.

    Sentences are sorted by length and decoded `batch_size` at a time (None: TRANSLATE_BATCH_SIZE), or with
    `max_tokens` instead as many as fit rows x padded width <= max_tokens (`translation_batches`), each batch padded
    to one of a few shapes, so compilations are few and reused; where the schedule says so (a CPU of two cores or
    more), several batches at once in threads of their own, which take the caller's matmul precision and default
    device. Weights on a mesh (`inference.load(mesh=...)`) decode each batch over it, its rows split over the
    'data' axis (`OverData`). For a file or stream of any size, `translate_lines` does this chunk by chunk.
    `schedule`: how each batch runs (default: `schedule.default()`); `encoded`: the sentences' ids as
    `encode_sources` gives them, where the caller has them already (a service counts tokens before it queues).
    `constraints`: phrases (text) each translation must hold, a list (or None) per sentence, in any order or in
    the order given as `decode.constraint_order` says; `decode.suppress`'s phrases appear in none. Bad phrases are
    a DataError naming the sentence, before anything is decoded.
    """
    decode = forced_language(decode, tokenizer)
    decode.aligned_layer(config)  # a layer the model lacks: a ConfigError before anything is encoded
    sources = list(encoded) if encoded is not None else encode_sources(tokenizer, sentences, config)
    if prefixes is not None and len(prefixes) != len(sources):
        raise ValueError(f"{len(prefixes)} prefixes for {len(sources)} sentences: give one (or None) per sentence")
    ids = None
    if prefixes is not None:
        ids = encode_prefixes(tokenizer, prefixes)
        check_prefixes(config, decode, sources, ids, [f"sentence {i}" for i in range(len(sources))])
    names = [f"sentence {i}" for i in range(len(sources))]
    if constraints is not None and len(constraints) != len(sources):
        raise ValueError(f"{len(constraints)} constraint lists for {len(sources)} sentences: one (or None) each")
    phrases = encode_constraints(tokenizer, config, decode, sources, ids, constraints, names)
    decoded = _decode_sources(
        params,
        config,
        sources,
        ids,
        decode,
        batch_size=batch_size,
        max_tokens=max_tokens,
        progress=progress,
        schedule=schedule,
        phrases=phrases,
        banned=encode_suppressed(tokenizer, config, decode),
    )
    prefixes = prefixes or [None] * len(sources)
    return [
        Translation(sentence, _hypotheses(tokenizer, found, config, source), prefix or None)
        for sentence, found, prefix, source in zip(sentences, decoded, prefixes, sources)
    ]


def _hypotheses(tokenizer, found: Decoded, config: TransformerConfig, source=None) -> list[Hypothesis]:
    """The hypotheses of one sentence (`found`: a Decoded of one row) as text, ids and scores; with alignments,
    their word alignments to `source` (the ids the model read)."""
    out = []
    for k, (tokens, score, token_scores, ok) in enumerate(
        zip(found.tokens[0], found.scores[0], found.token_scores[0], found.found[0])
    ):
        ends = np.flatnonzero(tokens == config.eos_id)
        n = int(ends[0]) + 1 if len(ends) else int(np.count_nonzero(tokens != config.pad_id))  # EOS included
        if ok:
            ids = [i for i in tokens[:n].tolist() if i != config.eos_id]
            aligned = None
            if found.alignments is not None:
                positions = found.alignments[0, k, :n]  # (n,) the source position of each token
                aligned = alignment.sentence_alignment(tokenizer, config, source, tokens[:n], positions)
            out.append(Hypothesis(tokenizer.decode(tokens), ids, float(score), token_scores[:n].tolist(), aligned))
    return out


def _decode_sources(
    params,
    config: TransformerConfig,
    sources: list[np.ndarray],
    prefixes: list[list[int] | None] | None,
    decode: DecodeConfig,
    *,
    batch_size: int | None,
    max_tokens: int | None,
    progress: bool,
    schedule: schedules.Schedule | None = None,
    phrases: list[list[list[int]] | None] | None = None,
    banned: list[list[int]] | None = None,
) -> list[Decoded]:
    """The hypotheses of encoded sources (ids + EOS), each a Decoded of one row, in their order; see `translate`.
    `phrases`: each source's phrases that must appear (ids; None: none); `banned`: phrases no output holds."""
    mesh = weights_mesh(params)  # on a mesh: every batch whole over it, its rows split over 'data'
    schedule, row_multiple = (schedule, 1) if mesh is None else (OverData(mesh), mesh.shape["data"])
    lengths = [len(s) for s in sources]
    plan = plan_translation(
        lengths, batch_size, config.max_len, schedule, max_tokens=max_tokens, row_multiple=row_multiple
    )
    params = on_device(params)  # once for all the batches of a call (of a chunk, for translate_lines)
    settings = schedules.callers_settings()  # the caller's matmul precision and device, in the pool's threads too

    def decode_batch(batch) -> Decoded:  # the hypotheses of one batch's rows
        chunk, rows, width = batch
        src = np.full((rows, width), config.pad_id, dtype=np.int32)  # filler rows stay all-PAD
        for row, i in enumerate(chunk):
            src[row, : len(sources[i])] = sources[i]
        given = None if prefixes is None else [prefixes[i] for i in chunk] + [None] * (rows - len(chunk))
        must = None  # the batch's phrases: none where no row has any (the program without constraints)
        if phrases is not None and any(phrases[i] for i in chunk):
            must = [phrases[i] for i in chunk] + [None] * (rows - len(chunk))
        with settings():
            return decoder(config, decode, width)(
                params, src, plan.schedule, given, must, None if not banned else [banned] * rows
            )

    out: list[Decoded | None] = [None] * len(sources)
    bar = tqdm(total=len(plan.batches), desc="translate", unit="batch", disable=not progress or len(plan.batches) < 2)
    with bar, ThreadPoolExecutor(plan.at_once) as pool:
        # A batch at a time in this thread, or several at once in the pool's (jax releases the GIL as programs run).
        decoded = pool.map(decode_batch, plan.batches) if plan.at_once > 1 else map(decode_batch, plan.batches)
        try:
            for (chunk, _, _), found in zip(plan.batches, decoded):
                for row, i in enumerate(chunk):
                    out[i] = found.row(row)
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
    unmet: int = 0  # lines with constraints for which the search found no output holding them all (written empty)
    unmet_lines: list[int] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        text = f"translated {self.lines - self.empty} lines ({self.lines} read, {self.empty} empty)"
        if self.truncated:
            shown = ", ".join(map(str, self.truncated_lines)) + (", ..." if self.truncated > 10 else "")
            text += f"; {self.truncated} truncated to the model's max_len (lines {shown})"
        if self.unmet:
            shown = ", ".join(map(str, self.unmet_lines)) + (", ..." if self.unmet > 10 else "")
            text += f"; {self.unmet} with no output holding all their constraints, written empty (lines {shown})"
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


OUTPUT_FORMATS = ("text", "tsv", "jsonl")


def format_translation(
    found: Translation | None, line: int, output_format: str, n_best: int = 1, alignments: bool = False
) -> list[str]:
    """The output lines of input line `line` (None: an empty line). text: each hypothesis's text on a line of its
    own (n_best lines per input line, "" where there is none); tsv: line, rank, score and text, tab-separated, a
    row per hypothesis (an empty line: one row with its line number and empty fields); jsonl: one JSON object
    with the source, the prefix and every hypothesis with its score, tokens and per-token log-probs. With
    `alignments`: each jsonl hypothesis has its "alignment" ("0-0 1-2 ..."), each tsv row a fifth column of it."""
    hypotheses = found.hypotheses if found is not None else []
    if output_format == "jsonl":
        record = {"line": line, "source": found.source if found else "", "prefix": found.prefix if found else None}
        drop = () if alignments else ("alignment",)  # a decoding without alignments writes the records it did
        record["hypotheses"] = [{k: v for k, v in dataclasses.asdict(h).items() if k not in drop} for h in hypotheses]
        return [json.dumps(record, ensure_ascii=False)]
    texts = [h.text.replace("\r", " ").replace("\n", " ") for h in hypotheses]  # one line per hypothesis
    if output_format == "tsv":  # an empty line (no hypothesis): one row of its line number alone
        rows = [f"{line}\t{rank}\t{h.score:.6g}\t{text}" for rank, (h, text) in enumerate(zip(hypotheses, texts), 1)]
        if alignments:
            rows = [f"{row}\t{h.alignment}" for row, h in zip(rows, hypotheses)]
            return rows or [f"{line}\t\t\t\t"]
        return rows or [f"{line}\t\t\t"]
    return (texts + [""] * n_best)[:n_best]


def translate_lines(
    params,
    config: TransformerConfig,
    tokenizer,
    lines: Iterable[str],
    write: Callable[[str], None],
    decode: DecodeConfig | None = None,
    *,
    origin: str = "input",
    on_too_long: str = "error",
    chunk_size: int = TRANSLATE_CHUNK_LINES,
    total: int | None = None,
    progress: bool | None = True,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    output_format: str = "text",
    prefix_column: bool = False,
    input_format: str | None = None,
    glossary: Glossary | None = None,
) -> TranslationReport:
    """Translates `lines` (any iterable of strings, e.g. a file read lazily) as `decode` says and calls
    `write(line)` for each output line, in order (`format_translation`: with n-best 1 and text, exactly one output
    per input; an empty (or blank) line gives an empty output, and line breaks inside a translation become
    spaces). With `prefix_column`, a line is "source<TAB>target prefix" (the prefix may be empty); `input_format`
    (INPUT_FORMATS) says the same as "tsv", or "constraints": "source<TAB>phrase<TAB>phrase..." (fairseq's format),
    or "jsonl": a JSON object a line with "source" and optionally "prefix" and "constraints" (a list of phrases).
    A chunk's bad lines (a bad phrase, a bad object) are a DataError naming `origin` and the line before the chunk
    is decoded (`check_lines` checks a whole file first). A `glossary` adds the target terms of the source terms a
    line holds to its constraints. Memory is
    bounded by `chunk_size` lines: each chunk is read, decoded (sorted by length into batches of `batch_size`
    sentences or of `max_tokens` token slots, as `translate` does) and written before the next is read.

    The too-long rule: a line of n tokens needs n + 1 <= config.max_len positions (EOS). With on_too_long="error"
    a longer line is a DataError naming `origin` and the line (the lines before it are already written); with
    "truncate" its first max_len - 1 tokens are translated, and the report counts and names the lines.
    `progress`: a tqdm bar on stderr counting lines (`total` lines if known; None: only when stderr is a terminal).
    """
    if on_too_long not in ON_TOO_LONG:
        raise ValueError(f"on_too_long must be one of {ON_TOO_LONG}, got {on_too_long!r}")
    if output_format not in OUTPUT_FORMATS:
        raise ValueError(f"output_format must be one of {OUTPUT_FORMATS}, got {output_format!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    check_batching(batch_size, max_tokens)  # before a line is read
    input_format = input_format or ("tsv" if prefix_column else "text")
    if input_format not in INPUT_FORMATS:
        raise ValueError(f"input_format must be one of {INPUT_FORMATS}, got {input_format!r}")
    decode = forced_language(decode, tokenizer)
    decode.aligned_layer(config)  # a layer the model lacks: a ConfigError before a line is read
    if decode.alignments and output_format == "text":
        raise UsageError(
            "--alignments writes each hypothesis's word pairs beside it: give --output-format tsv (a fifth column) "
            'or jsonl (an "alignment" field); text output has no place for them'
        )
    report = TranslationReport()
    banned = encode_suppressed(tokenizer, config, decode)
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
            chunk, prefixes, wanted = _parse_lines(chunk, input_format, origin, first, glossary)
            # Token ids of the non-empty lines, by index in the chunk; empty (or blank) lines stay empty.
            todo = [i for i, line in enumerate(chunk) if line.strip()]
            ids = dict(zip(todo, tokenizer.encode_batch([chunk[i] for i in todo])))
            too_long = None
            if on_too_long == "error":  # translate and write the lines before the first too-long one, then stop
                too_long = next((i for i in todo if len(ids[i]) > config.max_len - 1), None)
                if too_long is not None:
                    n_tokens = len(ids[too_long])
                    chunk, ids = chunk[:too_long], {i: v for i, v in ids.items() if i < too_long}
            done = sorted(ids)
            sources = [_apply_length_rule(ids[i], config, report, first + i) for i in done]
            prefix_ids, names = None, [f"{origin}, line {first + i}" for i in done]
            if any(prefixes):
                prefix_ids = encode_prefixes(tokenizer, [prefixes[i] for i in done])
                check_prefixes(config, decode, sources, prefix_ids, names)
            phrases = encode_constraints(
                tokenizer, config, decode, sources, prefix_ids, [wanted[i] for i in done], names
            )
            decoded = _decode_sources(
                params,
                config,
                sources,
                prefix_ids,
                decode,
                batch_size=batch_size,
                max_tokens=max_tokens,
                progress=False,
                phrases=phrases,
                banned=banned,
            )
            found = dict(zip(done, (Translation(chunk[i], _hypotheses(tokenizer, d, config, source),
                                                prefixes[i] or None)
                                    for i, d, source in zip(done, decoded, sources))))  # fmt: skip
            for i in (i for i in done if wanted[i] and not found[i].hypotheses):  # reported, never silently
                report.unmet += 1
                if len(report.unmet_lines) < 10:
                    report.unmet_lines.append(first + i)
            for i in range(len(chunk)):
                formatted = format_translation(found.get(i), first + i, output_format, decode.n_best, decode.alignments)
                for text in formatted:
                    write(text)
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


def check_prefixes(
    config: TransformerConfig,
    decode: DecodeConfig,
    sources: list[np.ndarray],
    prefixes: list[list[int] | None],
    names: list[str],
) -> None:
    """Each prefix against its sentence's length limit (it must leave room for a token of its own) and for EOS; a
    DataError naming the sentence (`names`) otherwise, before anything is decoded."""
    limits = decoder(config, decode, config.max_len).limits  # a row's limit depends on its source alone
    for source, prefix, name in zip(sources, prefixes, names):
        if not prefix:
            continue
        limit = int(limits(np.asarray(source, np.int32)[None])[0])
        if len(prefix) >= limit:
            raise DataError(
                f"{name}: a target prefix of {len(prefix)} tokens, but this sentence may produce {limit} tokens "
                f"in all (the prefix's and EOS included): shorten the prefix or raise the length limit"
            )
        if config.eos_id in prefix:
            raise DataError(f"{name}: the target prefix holds EOS (id {config.eos_id}): nothing could follow it")


INPUT_FORMATS = ("text", "tsv", "constraints", "jsonl")


def _parse_lines(
    chunk: list[str], input_format: str, origin: str, first: int, glossary: Glossary | None = None
) -> tuple[list[str], list[str | None], list[list[str] | None]]:
    """The sources, target prefixes and constraints (phrases; and the `glossary`'s terms) of lines numbered from
    `first` in `input_format`; a DataError naming `origin` and the line for one that is not of the format."""
    sources, prefixes, wanted = [], [], []
    for number, line in enumerate(chunk, first):
        prefix, phrases = None, None
        if input_format == "tsv":
            line, prefix = _split_prefix(line, origin, number)
        elif input_format == "constraints":  # fairseq's: source<TAB>phrase<TAB>phrase...
            line, *phrases = line.split("\t")
        elif input_format == "jsonl" and line.strip():
            line, prefix, phrases = _json_line(line, origin, number)
        sources.append(line)
        prefixes.append(prefix or None)
        wanted.append(glossary.constraints(line, phrases) if glossary is not None else phrases or None)
    return sources, prefixes, wanted


def _json_line(line: str, origin: str, number: int) -> tuple[str, str | None, list[str] | None]:
    """(source, prefix, constraints) of a JSON line: an object with "source" (a string) and optionally "prefix" (a
    string or null) and "constraints" (a list of strings, or null)."""
    where = f"{origin}, line {number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not a JSON object ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict) or not isinstance(record.get("source"), str):
        raise DataError(f'{where}: expected an object with a "source" string, got {line[:60]!r}')
    unknown = sorted(set(record) - {"source", "prefix", "constraints"})
    if unknown:
        raise DataError(f'{where}: unknown field {unknown[0]!r} (fields: "source", "prefix", "constraints")')
    prefix, phrases = record.get("prefix"), record.get("constraints")
    if prefix is not None and not isinstance(prefix, str):
        raise DataError(f'{where}: "prefix" must be a string or null, got {prefix!r}')
    if phrases is not None and (not isinstance(phrases, list) or not all(isinstance(p, str) for p in phrases)):
        raise DataError(f'{where}: "constraints" must be a list of strings, got {phrases!r}')
    return record["source"], prefix, phrases


def check_lines(
    config: TransformerConfig,
    tokenizer,
    lines: Iterable[str],
    decode: DecodeConfig,
    *,
    origin: str = "input",
    input_format: str = "text",
    chunk_size: int = TRANSLATE_CHUNK_LINES,
    glossary: Glossary | None = None,
) -> None:
    """What `translate_lines` checks of each chunk before decoding it (the lines' format, prefixes, constraints,
    `decode.suppress`), over every line first: a DataError naming `origin` and the line, before anything is
    decoded or written. Lines too long for the model are `translate_lines`' to handle (its `on_too_long`)."""
    decode = forced_language(decode, tokenizer)
    encode_suppressed(tokenizer, config, decode)
    iterator, first = iter(lines), 1
    while chunk := list(itertools.islice(iterator, chunk_size)):
        texts, prefixes, wanted = _parse_lines(chunk, input_format, origin, first, glossary)
        todo = [i for i, line in enumerate(texts) if line.strip()]
        ids = tokenizer.encode_batch([texts[i] for i in todo])
        sources = [np.array(list(x[: config.max_len - 1]) + [config.eos_id], np.int32) for x in ids]
        names = [f"{origin}, line {first + i}" for i in todo]
        prefix_ids = encode_prefixes(tokenizer, [prefixes[i] for i in todo]) if any(prefixes) else None
        if prefix_ids is not None:
            check_prefixes(config, decode, sources, prefix_ids, names)
        encode_constraints(tokenizer, config, decode, sources, prefix_ids, [wanted[i] for i in todo], names)
        first += len(chunk)


def _split_prefix(line: str, origin: str, number: int) -> tuple[str, str]:
    """(source, target prefix) of a "source<TAB>prefix" line; a line without a tab has no prefix."""
    parts = line.split("\t")
    if len(parts) > 2:
        raise DataError(f"{origin}, line {number}: {len(parts)} tab-separated fields; expected source<TAB>prefix")
    return parts[0], parts[1] if len(parts) == 2 else ""


def _apply_length_rule(ids, config: TransformerConfig, report: TranslationReport, line: int) -> np.ndarray:
    """ids + EOS of one line, its first max_len - 1 tokens when longer (counted in the report)."""
    limit = config.max_len - 1  # positions for tokens; one is left for EOS
    if len(ids) > limit:
        report.truncated += 1
        if len(report.truncated_lines) < 10:
            report.truncated_lines.append(line)
        ids = ids[:limit]
    return np.array(list(ids) + [config.eos_id], dtype=np.int32)
