"""The built-in task: English number words into French number words, from num2words, no download needed
("seventy-one thousand, two hundred and eighty" -> "soixante et onze mille deux cent quatre-vingts"). Small, yet a
real translation problem (French counts in twenties, "et" and the plural "s" follow rules), sized so that
`python train.py` learns it on 2 CPU cores in about two minutes. docs/internals.md#default_task."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
from num2words import num2words

from jax_transformer.data.corpus import Corpus

ORIGIN = "built-in num2words en->fr task"
NUMBER_RANGE = 1_000_000  # numbers 0 .. NUMBER_RANGE - 1
LEXICON = 100  # numbers 0 .. LEXICON - 1 are always in the training set
VALID_RESERVE = 1_000  # the first this many sampled numbers are held out for validation
DEFAULT_TRAIN_SIZE = 20_000  # the lexicon included; about 2% of all numbers
DEFAULT_VALID_SIZE = 500

# Tokenizer settings that suit this task: with BPE and 256 pieces every word between spaces and hyphens is
# a single piece. Unigram stops at ~110 pieces on this small vocabulary and splits words oddly ("▁", "and"),
# which makes sentences ~10% longer.
TOKENIZER_VOCAB_SIZE = 256
TOKENIZER_MODEL_TYPE = "bpe"


def number_pair(n: int) -> tuple[str, str]:
    """(English, French) words for the integer n, lowercase, exactly as num2words writes them."""
    return num2words(n, lang="en"), num2words(n, lang="fr")


@functools.lru_cache(maxsize=4)
def _sampled_order(seed: int) -> np.ndarray:
    """All numbers from LEXICON up, in a random order in which each digit count (3..6) is equally likely.

    Weighted sampling without replacement by exponential keys (Efraimidis and Spirakis): sorting by
    Exp(1) / weight draws items in proportion to their weights, then the next among those left, and so on.
    """
    numbers = np.arange(LEXICON, NUMBER_RANGE)
    digits = np.searchsorted(10 ** np.arange(1, 7), numbers, side="right") + 1  # 100 -> 3, 999 -> 3, 1000 -> 4
    class_size = np.bincount(digits)[digits]  # how many numbers share each number's digit count
    keys = np.random.default_rng(seed).exponential(size=numbers.size) * class_size  # Exp(1) / (1 / class_size)
    return numbers[np.argsort(keys, kind="stable")]


def default_numbers(split: str = "train", n: int | None = None, seed: int = 0) -> np.ndarray:
    """The integers of a split, ascending: `n` of them (default DEFAULT_TRAIN_SIZE / DEFAULT_VALID_SIZE).

    "valid" draws from the first VALID_RESERVE sampled numbers, "train" is 0..LEXICON-1 plus the sampled
    numbers after that reserve: the two never overlap. A larger n only adds numbers (a prefix property), so
    the training set of n=20,000 is contained in that of n=50,000.
    """
    order = _sampled_order(seed)
    if split == "valid":
        n = DEFAULT_VALID_SIZE if n is None else n
        if not 1 <= n <= VALID_RESERVE:
            raise ValueError(f"default task: valid size must be in [1, {VALID_RESERVE}], got {n}")
        chosen = order[:n]
    elif split == "train":
        n = DEFAULT_TRAIN_SIZE if n is None else n
        most = LEXICON + order.size - VALID_RESERVE
        if not LEXICON <= n <= most:
            raise ValueError(
                f"default task: train size must be in [{LEXICON}, {most}] (the {LEXICON} numbers "
                f"0..{LEXICON - 1} are always included), got {n}"
            )
        chosen = np.concatenate([np.arange(LEXICON), order[VALID_RESERVE : VALID_RESERVE + n - LEXICON]])
    else:
        raise ValueError(f"default task: split must be 'train' or 'valid', got {split!r}")
    return np.sort(chosen)


def default_pairs(split: str = "train", n: int | None = None, seed: int = 0) -> Corpus:
    """The built-in task's English -> French pairs of a split, numbers ascending (see `default_numbers`).

    Line numbers are 1-based positions, i.e. the lines of the TSV file `write_default_task` writes. Building
    the default 20,000 training pairs takes a few seconds (num2words).
    """
    numbers = default_numbers(split, n, seed)
    pairs = [number_pair(int(x)) for x in numbers]
    return Corpus(
        sources=[en for en, _ in pairs],
        targets=[fr for _, fr in pairs],
        line_numbers=list(range(1, len(pairs) + 1)),
        origin=ORIGIN,
    )


def write_default_task(
    directory: str | os.PathLike, *, n_train: int | None = None, n_valid: int | None = None, seed: int = 0
) -> tuple[Path, Path]:
    """Writes train.tsv and valid.tsv (`english<TAB>french` lines) into `directory`; returns their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n in (("train", n_train), ("valid", n_valid)):
        corpus = default_pairs(split, n, seed)
        path = directory / f"{split}.tsv"
        path.write_text("".join(f"{s}\t{t}\n" for s, t in zip(corpus.sources, corpus.targets)), encoding="utf-8")
        paths.append(path)
    return paths[0], paths[1]
