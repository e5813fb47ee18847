"""The tokenizer: one joint SentencePiece model for both languages, as the paper shares one subword vocabulary
between source and target (section 5.1), which is what lets the model share its embedding tables. Its special
ids are fixed: pad 0, bos 1, eos 2 (TransformerConfig's defaults), unk 3."""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import sentencepiece as spm

from jax_transformer.errors import DataError

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3

# Training options that the rest of the project relies on; callers may not override them.
_FIXED_TRAINER_OPTIONS = dict(
    pad_id=PAD_ID,
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    unk_id=UNK_ID,
    # Small corpora may not support the requested vocabulary; take what they support instead of failing.
    # The real size is Tokenizer.vocab_size, which the trainer copies into the model config.
    hard_vocab_limit=False,
    # One thread makes training deterministic: the same texts give byte-identical models.
    num_threads=1,
    minloglevel=2,  # errors only: SentencePiece otherwise logs hundreds of lines to stderr
)


class Tokenizer:
    """Subword tokenizer for both languages, with ids pad=0, bos=1, eos=2, unk=3.

    Build one with `Tokenizer.train`, `Tokenizer.from_bytes` (the serialized model, as stored in checkpoints)
    or `Tokenizer.load` (a SentencePiece `.model` file).
    """

    def __init__(self, model_bytes: bytes, *, source: str = "tokenizer model bytes") -> None:
        """Loads a serialized SentencePiece model; `source` names it in error messages."""
        processor = spm.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(model_bytes)
        except (RuntimeError, TypeError) as e:
            raise DataError(f"{source}: not a SentencePiece model ({len(model_bytes)} bytes): {e}") from None
        ids = (processor.pad_id(), processor.bos_id(), processor.eos_id(), processor.unk_id())
        if ids != (PAD_ID, BOS_ID, EOS_ID, UNK_ID):
            raise DataError(
                f"{source}: the model's pad/bos/eos/unk ids are {ids}, this project needs "
                f"{(PAD_ID, BOS_ID, EOS_ID, UNK_ID)}; train it with Tokenizer.train"
            )
        self._processor = processor
        self._bytes = bytes(model_bytes)

    # --- building ----------------------------------------------------------------------------------------------
    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        *,
        model_type: str = "unigram",
        character_coverage: float = 1.0,
        **sentencepiece_options,
    ) -> Tokenizer:
        """Trains a model in memory on `texts` (pass source and target sentences together: one joint vocab).

        `vocab_size` is an upper bound: a small corpus may yield fewer pieces (see `vocab_size`). model_type is
        "unigram" (SentencePiece's default) or "bpe" (the paper's byte-pair encoding). character_coverage=1.0
        keeps every character seen; 0.9995 is usual for languages with large alphabets. Other SentencePiece
        trainer options pass through, e.g. seed_sentencepiece_size, or input_sentence_size=1_000_000 with
        shuffle_input_sentence=True to train on a sample of a large corpus.
        """
        if isinstance(texts, str):  # iterating a str would train on its characters, one "sentence" each
            raise TypeError("Tokenizer.train takes an iterable of sentences, not one str")
        clash = sorted(set(sentencepiece_options) & set(_FIXED_TRAINER_OPTIONS))
        if clash:
            raise ValueError(f"Tokenizer.train: options {clash} are fixed by this project and cannot be changed")
        if model_type not in ("unigram", "bpe"):
            raise ValueError(f"Tokenizer.train: model_type must be 'unigram' or 'bpe', got {model_type!r}")
        count = 0

        def sentences() -> Iterator[str]:
            nonlocal count
            for text in texts:
                count += 1
                yield text

        writer = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=sentences(),
                model_writer=writer,
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=character_coverage,
                **_FIXED_TRAINER_OPTIONS,
                **sentencepiece_options,
            )
        except RuntimeError as e:  # a DataError (a ValueError): the command line reports it without a traceback
            raise DataError(
                f"Tokenizer.train: SentencePiece failed on {count} texts "
                f"(vocab_size={vocab_size}, model_type={model_type!r}): {e}"
            ) from None
        return cls(writer.getvalue(), source="freshly trained tokenizer")

    @classmethod
    def from_bytes(cls, model_bytes: bytes) -> Tokenizer:
        """The inverse of `to_bytes`."""
        return cls(model_bytes)

    def to_bytes(self) -> bytes:
        """The serialized model (a SentencePiece ModelProto); store it with a checkpoint."""
        return self._bytes

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Reads a `.model` file written by `save` (or by SentencePiece itself, if its special ids match)."""
        path = Path(path)
        try:
            model_bytes = path.read_bytes()
        except FileNotFoundError:
            raise DataError(f"{path}: tokenizer model file not found") from None
        except OSError as e:
            raise DataError(f"{path}: cannot read tokenizer model: {e.strerror or e}") from e
        return cls(model_bytes, source=str(path))

    def save(self, path: str | os.PathLike) -> None:
        """Writes the model as a SentencePiece `.model` file (readable by `load` and by the spm tools)."""
        Path(path).write_bytes(self._bytes)

    # --- using -------------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, specials included: ids are in [0, vocab_size)."""
        return self._processor.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Subword ids of one sentence, without BOS or EOS (see the module docstring for where they go)."""
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode takes one str, got {type(text).__name__}; use encode_batch")
        return self._processor.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` for many sentences in one call (faster than a Python loop)."""
        return self._processor.encode(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a model output row: stops at the first EOS and ignores PAD and BOS.

        `ids` may be a list or a 1-D numpy array. An id outside [0, vocab_size) is a ValueError: it means the
        model's vocabulary does not match this tokenizer.
        """
        kept = []
        for i in (int(x) for x in ids):
            if i == EOS_ID:
                break
            if i in (PAD_ID, BOS_ID):
                continue
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"Tokenizer.decode: id {i} is outside the vocabulary [0, {self.vocab_size})")
            kept.append(i)
        return self._processor.decode(kept)

    def pieces(self, text: str) -> list[str]:
        """The subword strings of `text` (for looking at what the tokenizer does)."""
        return self._processor.encode(text, out_type=str)
