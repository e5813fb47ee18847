"""The sentence pairs a `DataConfig` names, read into memory: the training or the validation files, or the built-in
task's pairs. (A training run reads its training files as `training.run.TrainingData`, without holding their
text.)"""

from __future__ import annotations

from jax_transformer.data import default_task
from jax_transformer.data.corpus import Corpus, read_parallel, read_tsv
from jax_transformer.settings.config import DataConfig


def load_corpus(data: DataConfig, split: str = "train") -> Corpus | None:
    """Reads the training ("train") or validation ("valid") pairs that `data` names into memory (DataError naming
    the file and line for bad input); None for "valid" when there are no validation files. No files at all: the
    built-in numbers task. (A run reads its training files as `TrainingData`, without holding their text.)"""
    if split not in ("train", "valid"):
        raise ValueError(f"split must be 'train' or 'valid', got {split!r}")
    if data.uses_default_task:
        return default_task.default_pairs(split)
    prefix = "" if split == "train" else "valid_"
    src, tgt, tsv = (getattr(data, prefix + name) for name in ("src", "tgt", "tsv"))
    if tsv is not None:
        return read_tsv(tsv, on_empty=data.on_empty, language_columns=data.language_columns)
    if src is not None:
        return read_parallel(src, tgt, on_empty=data.on_empty)
    return None
