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
from jax_transformer.decoding.decoders import on_device
from jax_transformer.decoding.translation import TRANSLATE_CHUNK_LINES, batch_buckets, decode_widths
from jax_transformer.errors import DataError
from jax_transformer.model.transformer import Transformer
from jax_transformer.settings.config import TransformerConfig

SCORE_BATCH_SIZE = 64  # pairs scored together


@dataclasses.dataclass(frozen=True)
class Score:
    """A pair's score: the sum of its target tokens' log-probs (EOS included), the tokens (ids, EOS last) and each
    one's log-prob."""

    score: float
    tokens: list[int]
    token_scores: list[float]


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
) -> list[Score]:
    """The Score of each (source, target) pair, in order. Pairs are sorted by length and scored `batch_size` at a
    time, padded to a few shapes (rows: `translation.batch_buckets`, widths: `translation.decode_widths`) so that
    compilations are few. A side longer than the model's max_len is a DataError naming the pair (`names`, default
    "pair i")."""
    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} sources and {len(targets)} targets: give one target per source")
    names = names or [f"pair {i}" for i in range(len(sources))]
    src_ids = [list(ids) + [config.eos_id] for ids in tokenizer.encode_batch(list(sources))]
    tgt_ids = [list(ids) for ids in tokenizer.encode_batch(list(targets), side="target")]
    for name, s, t in zip(names, src_ids, tgt_ids):
        if len(s) > config.max_len or len(t) + 1 > config.max_len:
            raise DataError(
                f"{name}: {len(s) - 1} source and {len(t)} target tokens, more than the model's max_len="
                f"{config.max_len} positions take (one more on each side for EOS, or the start token)"
            )
    params = on_device(params)
    widths, rows_of = decode_widths(config.max_len), batch_buckets(batch_size)
    order = np.argsort([max(len(s), len(t) + 1) for s, t in zip(src_ids, tgt_ids)], kind="stable")
    out: list[Score | None] = [None] * len(src_ids)
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
        for row, i in enumerate(chunk):
            n = len(tgt_ids[i]) + 1
            values = found[row, :n].astype(np.float64)
            out[i] = Score(float(values.sum()), tgt_ids[i] + [config.eos_id], [float(v) for v in values])
    return out


SCORE_FORMATS = ("text", "tsv", "jsonl")


def format_score(score: Score | None, line: int, output_format: str) -> str:
    """One output line for input line `line` (None: a pair that was not scored, an empty side). text: the score;
    tsv: line, score, tokens and per-token log-probs (space-separated); jsonl: a JSON object of the same."""
    if output_format == "jsonl":
        return json.dumps({"line": line, **(dataclasses.asdict(score) if score else {"score": None})})
    if score is None:
        return "" if output_format == "text" else f"{line}\t\t\t"
    if output_format == "text":
        return f"{score.score:.6g}"
    per_token = " ".join(f"{v:.6g}" for v in score.token_scores)
    return f"{line}\t{score.score:.6g}\t{' '.join(map(str, score.tokens))}\t{per_token}"


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
) -> int:
    """Scores (line, source, target) pairs (e.g. a `corpus.PairReader`, which skips pairs with an empty side) and
    calls `write` once per line from the first pair's line on, in order: a line the pairs skip gets an empty
    record, so that output line i stays input line i. Memory is bounded by `chunk_size` pairs. Returns the count
    of pairs scored."""
    if output_format not in SCORE_FORMATS:
        raise ValueError(f"output_format must be one of {SCORE_FORMATS}, got {output_format!r}")
    scored, last = 0, 0
    iterator = iter(pairs)
    with tqdm(desc="score", unit="pair", disable=None if progress is None else not progress) as bar:
        while chunk := list(itertools.islice(iterator, chunk_size)):
            lines, sources, targets = zip(*chunk)
            names = [f"{origin}, line {line}" for line in lines]
            found = score_pairs(params, config, tokenizer, sources, targets, names=names)
            for line, score in zip(lines, found):
                for gap in range(last + 1, line):  # lines the reader skipped
                    write(format_score(None, gap, output_format))
                write(format_score(score, line, output_format))
                last = line
            scored += len(chunk)
            bar.update(len(chunk))
    return scored
