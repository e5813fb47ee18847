#!/usr/bin/env python3
"""Decoding that users steer, measured on real data: lexical constraints with oracle terms and ensembles of
checkpoints, on Multi30k de->en's validation set (docs/decoding.md has the tables).

    # constraints: per sentence, one or two reference words the unconstrained beam search misses, then required
    # (Post & Vilar 2018's oracle setting): term accuracy and BLEU with and without, and the cost in tokens/s
    python benchmarks/steered_decoding.py constraints --checkpoint runs/m30k \
        --src ../shared/data/multi30k/val.de --ref ../shared/data/multi30k/val.en --json constraints.json

    # ensembles: BLEU of each model alone and of the ensemble of all, and the ensemble's cost against one model
    python benchmarks/steered_decoding.py ensemble --checkpoint runs/m30k-s1 --checkpoint runs/m30k-s2 \
        --src ../shared/data/multi30k/val.de --ref ../shared/data/multi30k/val.en --json ensemble.json

Speed is compared alternately, the same sentences each time, after one untimed pass that compiles every program; the
minimum and median of the repeats are printed, with the machine they ran on.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import machine_info  # noqa: E402

# Words not worth requiring: function words of English (an oracle term should be a content word the model missed).
STOPWORDS = set(
    "a an the and or but of in on at to for with from by as is are was were be been being it its this that these "
    "those there their they them he she his her him we our you your i my me while into onto over under near next "
    "some one two three four five other another each".split()
)
WORD = re.compile(r"\w+", re.UNICODE)


def words(text: str) -> list[str]:
    return WORD.findall(text)


def oracle_terms(hypothesis: str, reference: str, most: int = 2) -> list[str]:
    """Up to `most` reference words (content words of 4 letters or more, first occurrence order) that `hypothesis`
    does not contain as a whole word (case-insensitive): the terms a user would have asked for."""
    have = {w.lower() for w in words(hypothesis)}
    terms: list[str] = []
    for w in words(reference):
        if len(w) >= 4 and w.isalpha() and w.lower() not in STOPWORDS and w.lower() not in have and w not in terms:
            terms.append(w)
        if len(terms) == most:
            break
    return terms


def term_accuracy(hypotheses: list[str], terms: list[list[str]]) -> tuple[float, int]:
    """The share of required terms present in their sentence's output as a whole word (case as given), and the count
    of terms."""
    present = total = 0
    for hypothesis, wanted in zip(hypotheses, terms):
        have = set(words(hypothesis))
        present += sum(t in have for t in wanted)
        total += len(wanted)
    return (present / total if total else float("nan")), total


def read_lines(path: str, limit: int | None) -> list[str]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return lines[:limit] if limit else lines


def bleu(hypotheses: list[str], references: list[str]) -> float:
    from jax_transformer.decoding.evaluation import score_translations

    return round(score_translations(hypotheses, references)["bleu"], 2)


def timed(translate, repeats: int) -> dict[str, dict]:
    """{name: {"seconds": [...], "tokens": n}} of each named call, alternated `repeats` times after a warm-up call of
    each (compiling)."""
    results = {name: {"seconds": [], "tokens": 0} for name in translate}
    for name, call in translate.items():
        results[name]["tokens"] = sum(len(t.hypotheses[0].tokens) for t in call())
    for _ in range(repeats):
        for name, call in translate.items():
            start = time.perf_counter()
            call()
            results[name]["seconds"].append(time.perf_counter() - start)
    for r in results.values():
        r["tokens_per_s_best"] = round(r["tokens"] / min(r["seconds"]), 1)
        r["tokens_per_s_median"] = round(r["tokens"] / statistics.median(r["seconds"]), 1)
    return results


def constraints(args) -> dict:
    from jax_transformer import Translator

    if args.speed_only:  # the oracle terms of the timed sentences need their plain translations only
        args.limit = args.timing_sentences

    translator = Translator(args.checkpoint[0])
    sources, references = read_lines(args.src, args.limit), read_lines(args.ref, args.limit)
    out: dict = {"machine": machine_info(), "checkpoint": args.checkpoint[0], "sentences": len(sources), "rows": []}
    for beam in args.beams:
        plain = [t.text for t in translator.translate(sources, beam_size=beam, progress=True)]
        terms = [oracle_terms(h, r) for h, r in zip(plain, references)]
        constrained = [t.text for t in translator.translate(sources, beam_size=beam, constraints=terms, progress=True)]
        accuracy_plain, n_terms = term_accuracy(plain, terms)
        accuracy_constrained, _ = term_accuracy(constrained, terms)
        row = {
            "beam": beam,
            "sentences_with_terms": sum(bool(t) for t in terms),
            "terms": n_terms,
            "term_accuracy_plain": round(accuracy_plain, 4),
            "term_accuracy_constrained": round(accuracy_constrained, 4),
            "bleu_plain": bleu(plain, references),
            "bleu_constrained": bleu(constrained, references),
        }
        timing_sources = sources[: args.timing_sentences]
        timing_terms = terms[: args.timing_sentences]
        speed = timed(
            {
                "plain": lambda: translator.translate(timing_sources, beam_size=beam),
                "constrained": lambda: translator.translate(timing_sources, beam_size=beam, constraints=timing_terms),
            },
            args.repeats,
        )
        row["speed"] = speed
        row["cost_median"] = round(
            speed["plain"]["tokens_per_s_median"] / speed["constrained"]["tokens_per_s_median"], 2
        )
        out["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "speed"}), flush=True)
    return out


def ensemble(args) -> dict:
    from jax_transformer import Translator

    sources, references = read_lines(args.src, args.limit), read_lines(args.ref, args.limit)
    out: dict = {"machine": machine_info(), "checkpoints": args.checkpoint, "sentences": len(sources), "rows": []}
    alone = [Translator(path) for path in args.checkpoint]
    for path, translator in zip(args.checkpoint, [] if args.speed_only else alone):
        hypotheses = [t.text for t in translator.translate(sources, beam_size=args.beams[0], progress=True)]
        out["rows"].append({"models": [path], "bleu": bleu(hypotheses, references)})
        print(json.dumps(out["rows"][-1]), flush=True)
    together = Translator(args.checkpoint)
    hypotheses = (
        [] if args.speed_only else [t.text for t in together.translate(sources, beam_size=args.beams[0], progress=True)]
    )
    if hypotheses:
        out["rows"].append({"models": args.checkpoint, "bleu": bleu(hypotheses, references)})
        print(json.dumps(out["rows"][-1]), flush=True)
    timing_sources = sources[: args.timing_sentences]
    out["speed"] = timed(
        {
            "one model": lambda: alone[0].translate(timing_sources, beam_size=args.beams[0]),
            f"ensemble of {len(alone)}": lambda: together.translate(timing_sources, beam_size=args.beams[0]),
        },
        args.repeats,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("constraints", "ensemble"))
    parser.add_argument("--checkpoint", action="append", required=True, help="a run directory (repeat: ensemble)")
    parser.add_argument("--src", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--beams", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--limit", type=int, default=None, help="the first N sentences only")
    parser.add_argument("--timing-sentences", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--speed-only", action="store_true", help="the cost alone, on --timing-sentences")
    args = parser.parse_args()
    out = constraints(args) if args.what == "constraints" else ensemble(args)
    print(json.dumps({k: v for k, v in out.items() if k != "machine"}, indent=1))
    print("machine:", json.dumps(out["machine"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
