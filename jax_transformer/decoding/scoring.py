"""The log-probability the model gives to translations it is shown (CTranslate2's `score_batch`): each target token's
log P given the source and the tokens before it (teacher forcing: one forward pass, no search), EOS included, and
their sum. For filtering a corpus (a low score flags a bad pair) and for reranking n-best lists. `score_pairs` takes
sentence pairs; `score_lines` streams them from a file, a chunk at a time, as `translate_lines` does."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jax_transformer.compilation import jit_by_config
from jax_transformer.data.corpus import MAX_REPORTED_LINES, PairReader
from jax_transformer.decoding import alignment
from jax_transformer.decoding.decoders import on_device
from jax_transformer.decoding.translation import TRANSLATE_CHUNK_LINES, batch_buckets, decode_widths
from jax_transformer.errors import DataError, UsageError
from jax_transformer.model.transformer import Transformer
from jax_transformer.settings.config import TransformerConfig

SCORE_BATCH_SIZE = 64  # pairs scored together


@dataclasses.dataclass(frozen=True)
class Score:
    """A pair's score: the sum of its target tokens' log-probs (EOS included), the tokens (ids, EOS last) and each
    one's log-prob; asked for, its word alignment ("0-0 1-2 ...": `alignment.sentence_alignment`), else None."""

    score: float
    tokens: list[int]
    token_scores: list[float]
    alignment: str | None = None


@functools.partial(jit_by_config, static_argnames=("config",))
def token_log_probs(params, src, tgt_in, tgt_out, *, config: TransformerConfig):
    """(B, T) the log-prob of each tgt_out token given src (B, S) and tgt_in (B, T) (0 at padding)."""
    logits = Transformer(config).apply({"params": params}, src, tgt_in)  # (B, T, V)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_probs, tgt_out[..., None], axis=-1)[..., 0]  # (B, T)
    return jnp.where(tgt_out != config.pad_id, picked, 0.0)


def score_pairs(
    params,
    config: TransformerConfig,
    tokenizer,
    sources: Sequence[str],
    targets: Sequence[str],
    *,
    batch_size: int = SCORE_BATCH_SIZE,
    names: Sequence[str] | None = None,
    on_too_long: str = "error",
    alignment_layer: int | None = None,
) -> list[Score | None]:
    """The Score of each (source, target) pair, in order. Pairs are sorted by length and scored `batch_size` at a
    time, padded to a few shapes (rows: `translation.batch_buckets`, widths: `translation.decode_widths`) so that
    compilations are few. A side longer than the model's max_len is a DataError naming the pair (`names`, default
    "pair i"), or with on_too_long="skip" a None in its place (`too_long` says why). `alignment_layer`: the decoder
    layer whose cross-attention aligns each pair's words (`DecodeConfig.aligned_layer`; None: no alignments), in a
    pass of its own, so that the scores are those of a scoring without."""
    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} sources and {len(targets)} targets: give one target per source")
    if on_too_long not in ON_TOO_LONG:
        raise ValueError(f"on_too_long must be one of {ON_TOO_LONG}, got {on_too_long!r}")
    names = names or [f"pair {i}" for i in range(len(sources))]
    src_ids = [list(ids) + [config.eos_id] for ids in tokenizer.encode_batch(list(sources))]
    tgt_ids = [list(ids) for ids in tokenizer.encode_batch(list(targets), side="target")]
    out: list[Score | None] = [None] * len(src_ids)
    kept = []
    for i, (name, s, t) in enumerate(zip(names, src_ids, tgt_ids)):
        if len(s) > config.max_len or len(t) + 1 > config.max_len:
            if on_too_long == "error":
                raise DataError(too_long(name, len(s) - 1, len(t), config))
        else:
            kept.append(i)
    params = on_device(params)
    widths, rows_of = decode_widths(config.max_len), batch_buckets(batch_size)
    kept = np.asarray(kept, np.int64)
    order = kept[np.argsort([max(len(src_ids[i]), len(tgt_ids[i]) + 1) for i in kept], kind="stable")]
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        rows = next(r for r in rows_of if r >= len(chunk))
        S = next(w for w in widths if w >= max(len(src_ids[i]) for i in chunk))
        T = next(w for w in widths if w >= max(len(tgt_ids[i]) + 1 for i in chunk))
        src, tgt_in, tgt_out = (np.full((rows, width), config.pad_id, np.int32) for width in (S, T, T))
        for row, i in enumerate(chunk):
            t = tgt_ids[i]
            src[row, : len(src_ids[i])] = src_ids[i]
            tgt_in[row, : len(t) + 1] = [config.start_id] + t
            tgt_out[row, : len(t) + 1] = t + [config.eos_id]
        found = np.asarray(token_log_probs(params, src, tgt_in, tgt_out, config=config))  # (rows, T)
        aligned = None
        if alignment_layer is not None:
            aligned = alignment.teacher_forced_alignments(params, config, alignment_layer, src, tgt_in)  # (rows, T)
        for row, i in enumerate(chunk):
            n = len(tgt_ids[i]) + 1
            values = found[row, :n].astype(np.float64)
            tokens = tgt_ids[i] + [config.eos_id]
            pairs = None
            if aligned is not None:
                pairs = alignment.sentence_alignment(tokenizer, config, src_ids[i], tokens, aligned[row, :n])
            out[i] = Score(float(values.sum()), tokens, [float(v) for v in values], pairs)
    return out


SCORE_FORMATS = ("text", "tsv", "jsonl")


ON_TOO_LONG = ("error", "skip")


def too_long(name: str, source_tokens: int, target_tokens: int, config: TransformerConfig) -> str:
    """Why a pair cannot be scored: a side longer than the model's positions."""
    return (
        f"{name}: {source_tokens} source and {target_tokens} target tokens, more than the model's max_len="
        f"{config.max_len} positions take (one more on each side for EOS, or the start token)"
    )


def format_score(score: Score | None, line: int, output_format: str, alignments: bool = False) -> str:
    """One output line for input line `line` (None: a pair that was not scored, an empty side). text: the score;
    tsv: line, score, tokens and per-token log-probs (space-separated); jsonl: a JSON object of the same. With
    `alignments`, the word alignment too: a fifth tsv column, a jsonl "alignment" field."""
    if output_format == "jsonl":
        record = dataclasses.asdict(score) if score else {"score": None}
        if not alignments:  # a scoring without alignments writes the records it did
            record.pop("alignment", None)
        return json.dumps({"line": line, **record})
    if score is None:
        return "" if output_format == "text" else f"{line}\t\t\t" + "\t" * alignments
    if output_format == "text":
        return f"{score.score:.6g}"
    per_token = " ".join(f"{v:.6g}" for v in score.token_scores)
    row = f"{line}\t{score.score:.6g}\t{' '.join(map(str, score.tokens))}\t{per_token}"
    return f"{row}\t{score.alignment}" if alignments else row


@dataclasses.dataclass
class ScoreReport:
    """What `score_lines` did: pairs scored, and the lines skipped as longer than the model takes (the first
    MAX_REPORTED_LINES of them named)."""

    scored: int = 0
    too_long: int = 0
    too_long_lines: list[int] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        text = f"scored {self.scored} pairs"
        if self.too_long:
            more = ", ..." if self.too_long > len(self.too_long_lines) else ""
            lines = ", ".join(map(str, self.too_long_lines)) + more
            text += f"; skipped {self.too_long} longer than the model takes (an empty record each: lines {lines})"
        return text


def score_lines(
    params,
    config: TransformerConfig,
    tokenizer,
    pairs: Iterable[tuple[int, str, str]],
    write: Callable[[str], None],
    *,
    origin: str = "input",
    output_format: str = "text",
    chunk_size: int = TRANSLATE_CHUNK_LINES,
    progress: bool | None = True,
    on_too_long: str = "error",
    alignment_layer: int | None = None,
) -> ScoreReport:
    """Scores (line, source, target) pairs (e.g. a `corpus.PairReader`, which skips pairs with an empty side) and
    calls `write` once per line, in order: a line the pairs skip gets an empty record, so that output line i stays
    input line i (to the last line a `PairReader` read). Memory is bounded by `chunk_size` pairs.

    A pair with a side longer than the model takes: with on_too_long="error", a DataError naming `origin` and the
    line, after the records of the lines before it are written; with "skip", an empty record in its place, counted
    and named in the report. `alignment_layer`: as for `score_pairs`, each record with its pair's word alignment
    (tsv or jsonl)."""
    if output_format not in SCORE_FORMATS:
        raise ValueError(f"output_format must be one of {SCORE_FORMATS}, got {output_format!r}")
    aligns = alignment_layer is not None
    if aligns and output_format == "text":
        raise UsageError(
            "--alignments writes each pair's word alignment beside its score: give --output-format tsv (a fifth "
            'column) or jsonl (an "alignment" field)'
        )
    if on_too_long not in ON_TOO_LONG:
        raise ValueError(f"on_too_long must be one of {ON_TOO_LONG}, got {on_too_long!r}")
    report, last = ScoreReport(), 0
    iterator = iter(pairs)
    with tqdm(desc="score", unit="pair", disable=None if progress is None else not progress) as bar:
        while chunk := list(itertools.islice(iterator, chunk_size)):
            lines, sources, targets = zip(*chunk)
            names = [f"{origin}, line {line}" for line in lines]
            found = score_pairs(params, config, tokenizer, sources, targets, names=names, on_too_long="skip",
                                alignment_layer=alignment_layer)  # fmt: skip
            for line, source, target, score in zip(lines, sources, targets, found):
                for gap in range(last + 1, line):  # lines the reader skipped
                    write(format_score(None, gap, output_format, aligns))
                if score is None and on_too_long == "error":  # what comes before it is written, then it stops
                    n_source, n_target = (len(ids) for ids in _token_counts(tokenizer, source, target))
                    raise DataError(
                        too_long(f"{origin}, line {line}", n_source, n_target, config)
                        + "; the lines before it are scored; pass --on-too-long skip to write an empty record "
                        "for such lines"
                    )
                write(format_score(score, line, output_format, aligns))
                last = line
                if score is None:
                    report.too_long += 1
                    if len(report.too_long_lines) < MAX_REPORTED_LINES:
                        report.too_long_lines.append(line)
                else:
                    report.scored += 1
            bar.update(len(chunk))
    end = pairs.lines if isinstance(pairs, PairReader) else last  # a reader's last line; a list's: its last pair
    for gap in range(last + 1, end + 1):  # lines after the last pair, skipped too
        write(format_score(None, gap, output_format, aligns))
    return report


def _token_counts(tokenizer, source: str, target: str) -> tuple[list[int], list[int]]:
    return tokenizer.encode_batch([source])[0], tokenizer.encode_batch([target], side="target")[0]
