#!/usr/bin/env python3
"""Sentence splitters for `translate --document` (jax_transformer/decoding/documents.py), compared on real sentences:
sentencex (Wikimedia), pysbd, and a regex baseline (a split after . ! ? or … before a space).

    python benchmarks/splitters.py                        # the data in ../shared/data (or --data DIR)
    python benchmarks/splitters.py --repeats 7 --json splitters.json

The sentences are the validation sets of Multi30k (de-en) and Tatoeba (the anki-deu-eng corpus), one sentence a
line; a line without an end mark (. ! ? …, a closing quote after it) is left out, as no splitter could find its end.
Consecutive sentences are joined by a space into paragraphs of 3 to 6 (seeded), each paragraph is split, and a
paragraph counts as exact when the splitter gives back its sentences, no more, no fewer. A few Tatoeba lines hold two
sentences ("Wait a minute. Something's not right."): every splitter that splits them misses those paragraphs alike.
The speed is sentences per second over all paragraphs of both sets, per language, min and median of --repeats (run
it alone on the machine: the figures are wall time). `documents.Segmenter` (sentencex within each line, the
layout's pieces around it) is timed beside the libraries it wraps.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/splitters.py` puts benchmarks/ first on the path, not the repo
    sys.path.insert(0, str(REPO))

from benchmarks.machine import core_count, cpu_model  # noqa: E402

SETS = {"Multi30k val": "multi30k/val", "Tatoeba valid": "anki-deu-eng/valid"}
LANGUAGES = ("de", "en")
ENDED = re.compile(r"[.!?…][\"'”“»«)]*$")
REGEX = re.compile(r"(?<=[.!?…])\s+")


def paragraphs(path: Path, rng: random.Random) -> tuple[list[list[str]], int]:
    """The file's sentences that end with an end mark, in order, grouped 3 to 6 at a time; and how many there are."""
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    sentences = [line for line in lines if ENDED.search(line)]
    groups, at = [], 0
    while at < len(sentences):
        size = rng.randint(3, 6)
        groups.append(sentences[at : at + size])
        at += size
    return groups, len(sentences)


def splitters(language: str) -> dict[str, Callable[[str], list[str]]]:
    import pysbd
    import sentencex

    from jax_transformer.decoding.documents import Segmenter

    segmenter = Segmenter(language)
    pysbd_segmenter = pysbd.Segmenter(language=language, clean=False)
    return {
        "regex": lambda text: REGEX.split(text),
        "pysbd": pysbd_segmenter.segment,
        "sentencex": lambda text: sentencex.segment(language, text),
        "documents.Segmenter": lambda text: [piece for piece, sentence in segmenter.pieces(text) if sentence],
    }


def exact(split: Callable[[str], list[str]], groups: list[list[str]]) -> float:
    """The share of paragraphs split into exactly their sentences."""
    right = sum([s.strip() for s in split(" ".join(group)) if s.strip()] == group for group in groups)
    return right / len(groups)


def speed(split: Callable[[str], list[str]], texts: list[str], sentences: int, repeats: int) -> tuple[float, float]:
    """Sentences per second splitting `texts`: (min, median) over `repeats`."""
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for text in texts:
            split(text)
        rates.append(sentences / (time.perf_counter() - start))
    return min(rates), statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data", help="the shared data folder")
    parser.add_argument("--repeats", type=int, default=5, help="timing repeats (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the paragraph sizes (default 0)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args()

    versions = {name: importlib.metadata.version(name) for name in ("sentencex", "pysbd")}
    machine = f"{cpu_model()}, {core_count()} cores, Python {platform.python_version()}"
    print(f"{datetime.date.today()}: {machine}; " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    results = {"date": str(datetime.date.today()), "machine": machine, "versions": versions, "rows": []}
    for language in LANGUAGES:
        found = splitters(language)
        data = {}
        for name, stem in SETS.items():
            groups, count = paragraphs(args.data / f"{stem}.{language}", random.Random(args.seed))
            data[name] = (groups, count)
            print(f"{name} {language}: {count} sentences in {len(groups)} paragraphs")
        texts = [" ".join(group) for groups, _ in data.values() for group in groups]
        sentences = sum(count for _, count in data.values())
        for splitter, split in found.items():
            shares = {name: exact(split, groups) for name, (groups, _) in data.items()}
            low, middle = speed(split, texts, sentences, args.repeats)
            results["rows"].append(
                {"language": language, "splitter": splitter, "exact": shares, "sentences_per_s": [low, middle]}
            )
    print()
    print("| splitter | language | " + " | ".join(f"exact, {name}" for name in SETS) + " | sentences/s, min / median |")
    print("|---|---|" + "---|" * len(SETS) + "---|")
    for row in results["rows"]:
        shares = " | ".join(f"{row['exact'][name]:.1%}" for name in SETS)
        low, middle = row["sentences_per_s"]
        print(f"| {row['splitter']} | {row['language']} | {shares} | {low:,.0f} / {middle:,.0f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
