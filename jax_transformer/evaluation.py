"""Translation quality: decode sentences (`jax_transformer.decoding`) and score them with sacreBLEU: BLEU and chrF
on detokenized text with their signatures, and BLEU lowercased and 13a-tokenized for comparison with tutorials.
docs/internals.md#evaluation."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_transformer.config import DecodeConfig, TransformerConfig
from jax_transformer.translation import translate


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
    progress: bool = True,
) -> tuple[dict[str, float | str], list[str]]:
    """Translates `sources` as `decode` says (default: `DecodeConfig()`) and scores the best translations against
    `references`: (scores as `score_translations` gives them, hypotheses)."""
    hypotheses = translate(params, config, tokenizer, list(sources), decode, progress=progress)
    return score_translations(hypotheses, references), hypotheses
