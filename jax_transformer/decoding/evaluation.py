"""Translation quality: decode sentences (`jax_transformer.decoding.decoders`) and score them with sacreBLEU: BLEU and
chrF on detokenized text with their signatures, and BLEU lowercased and 13a-tokenized for comparison with tutorials.
docs/internals.md#evaluation."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_transformer.data.corpus import pair_name
from jax_transformer.decoding.translation import translate
from jax_transformer.settings.config import DecodeConfig, TransformerConfig


def spread_indices(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n): sample translations from across a (often sorted) corpus."""
    return sorted(set(np.linspace(0, n - 1, num=min(k, n), dtype=int).tolist())) if n and k > 0 else []


def score_translations(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float | str]:
    """Corpus BLEU and chrF (sacreBLEU's defaults: 13a tokenization, cased, detokenized input), the lowercased
    BLEU (see the module docstring) and their signatures: {"bleu", "chrf", "bleu_lc", "bleu_signature",
    "chrf_signature", "bleu_lc_signature"}."""
    from sacrebleu.metrics import BLEU, CHRF

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    bleu, chrf, bleu_lc = BLEU(), CHRF(), BLEU(lowercase=True, tokenize="13a")
    hypotheses, refs = list(hypotheses), [list(references)]
    return {  # each signature is read after its corpus_score (sacreBLEU knows the reference count only then)
        "bleu": bleu.corpus_score(hypotheses, refs).score,
        "chrf": chrf.corpus_score(hypotheses, refs).score,
        "bleu_lc": bleu_lc.corpus_score(hypotheses, refs).score,
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "bleu_lc_signature": str(bleu_lc.get_signature()),
    }


def evaluate_translations(
    params,
    config: TransformerConfig,
    tokenizer,
    sources: Sequence[str],
    references: Sequence[str],
    decode: DecodeConfig | None = None,
    *,
    languages: Sequence[tuple[str, str]] | None = None,
    progress: bool = True,
) -> tuple[dict[str, float | str], list[str]]:
    """Translates `sources` as `decode` says (default: `DecodeConfig()`) and scores the best translations against
    `references`: (scores as `score_translations` gives them, hypotheses).

    With `languages` (each sentence's (source, target) codes: a corpus of many language pairs), the sentences of
    each pair are decoded together, that pair's target code forced first, and the scores hold each pair's too
    (`score_pairs`): BLEU and chrF over all hypotheses, and per pair."""
    if languages is None:
        hypotheses = translate(params, config, tokenizer, list(sources), decode, progress=progress)
        return score_translations(hypotheses, references), hypotheses
    hypotheses = [""] * len(sources)
    for (src_lang, tgt_lang), rows in by_pair(languages).items():
        pair_tokenizer = tokenizer.with_languages(src_lang, tgt_lang)
        for i, hypothesis in zip(
            rows, translate(params, config, pair_tokenizer, [sources[i] for i in rows], decode, progress=progress)
        ):
            hypotheses[i] = hypothesis
    return {**score_translations(hypotheses, references), **score_pairs(hypotheses, references, languages)}, hypotheses


def first_rows(languages: Sequence[tuple[str, str]] | None, n: int) -> list[int]:
    """The indices of n validation rows, in order: the first n, or with languages the first rows of every pair in
    turn (a file grouped by pair, evaluated on part of it, then still reports every pair)."""
    if languages is None or n >= len(languages):
        return list(range(n if languages is None else len(languages)))
    queues = [iter(rows) for rows in by_pair(languages).values()]
    picked: list[int] = []
    while len(picked) < n:
        for queue in queues:
            row = next(queue, None)
            if row is not None and len(picked) < n:
                picked.append(row)
    return sorted(picked)


def by_pair(languages: Sequence[tuple[str, str]]) -> dict[tuple[str, str], list[int]]:
    """The sentence indices of each language pair, pairs in order of first appearance."""
    rows: dict[tuple[str, str], list[int]] = {}
    for i, pair in enumerate(languages):
        rows.setdefault(tuple(pair), []).append(i)
    return rows


def score_pairs(
    hypotheses: Sequence[str], references: Sequence[str], languages: Sequence[tuple[str, str]]
) -> dict[str, float | int]:
    """Each language pair's corpus BLEU, chrF and sentence count, as "bleu/<src>-<tgt>", "chrf/<src>-<tgt>" and
    "sentences/<src>-<tgt>" (flat keys: metrics.jsonl's fields and TensorBoard's tags). sacreBLEU's statistics of the
    pairs add up to the whole corpus's, from which the overall BLEU and chrF are computed."""
    from sacrebleu.metrics import BLEU, CHRF

    scores: dict[str, float | int] = {}
    for pair, rows in sorted(by_pair(languages).items()):
        name = pair_name(pair)
        hyps, refs = [hypotheses[i] for i in rows], [[references[i] for i in rows]]
        scores[f"bleu/{name}"] = BLEU().corpus_score(hyps, refs).score
        scores[f"chrf/{name}"] = CHRF().corpus_score(hyps, refs).score
        scores[f"sentences/{name}"] = len(rows)
    return scores


def describe_pairs(scores: dict) -> str:
    """The per-pair scores of `score_pairs` in one line ("" when there are none)."""
    names = [key.split("/", 1)[1] for key in scores if key.startswith("sentences/")]
    return "; ".join(
        f"{name} BLEU {scores[f'bleu/{name}']:.2f}, chrF {scores[f'chrf/{name}']:.2f} "
        f"({scores[f'sentences/{name}']} sentences)"
        for name in names
    )


def describe_sweep(rows: list[dict], best: int) -> list[str]:
    """`evaluate`'s report of its decodings (`rows`: each one's scores, beam_size, alpha and seconds; `best`: the
    index of the best BLEU): one line for a single decoding, else a Markdown table; then sacreBLEU's signatures."""
    if len(rows) == 1:
        row = rows[0]
        lines = [
            f"BLEU {row['bleu']:.2f}, chrF {row['chrf']:.2f} (beam {row['beam_size']}, alpha {row['alpha']:g}); "
            f"lowercased 13a-tokenized BLEU {row['bleu_lc']:.2f}"
        ]
        if pairs := describe_pairs(row):
            lines.append(f"per language pair: {pairs}")
    else:
        lines = ["| beam | alpha | BLEU | chrF | BLEU lowercased | seconds |\n|---:|---:|---:|---:|---:|---:|"]
        for i, row in enumerate(rows):
            alpha = "-" if row["beam_size"] == 1 else f"{row['alpha']:g}"  # greedy has no length penalty
            mark = " (best)" if i == best else ""
            lines.append(
                f"| {row['beam_size']} | {alpha} | {row['bleu']:.2f}{mark} | {row['chrf']:.2f} | "
                f"{row['bleu_lc']:.2f} | {row['seconds']:.1f} |"
            )
    lines.append(f"sacreBLEU signatures: BLEU {rows[0]['bleu_signature']}; chrF {rows[0]['chrf_signature']}")
    lines.append(f"lowercased BLEU: {rows[0]['bleu_lc_signature']}")
    return lines
