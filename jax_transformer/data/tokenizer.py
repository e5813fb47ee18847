"""The tokenizers. This project trains one joint SentencePiece model for both languages, as the paper shares one
subword vocabulary between source and target (section 5.1), which is what lets the model share its embedding
tables; its special ids are fixed: pad 0, bos 1, eos 2 (TransformerConfig's defaults), unk 3. Imported models bring
theirs (`MarianTokenizer`, `FsmtTokenizer`); `load_tokenizer` reads any of them back from a checkpoint."""

from __future__ import annotations

import base64
import io
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import sentencepiece as spm

from jax_transformer import files
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


def unigram_model_bytes(texts: Iterable[str], vocab_size: int) -> bytes:
    """A unigram SentencePiece model of `texts` with SentencePiece's own special ids (<unk> 0, <s> 1, </s> 2), as
    Marian's source.spm / target.spm are: the serialized bytes, the same every time (one thread)."""
    writer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=writer,
        vocab_size=vocab_size,
        model_type="unigram",
        minloglevel=2,
        num_threads=1,
        hard_vocab_limit=False,
    )
    return writer.getvalue()


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
        files.write_bytes(path, self._bytes)

    # --- using -------------------------------------------------------------------------------------------------
    kind = "sentencepiece"
    pad_id, start_id, eos_id = PAD_ID, BOS_ID, EOS_ID  # start: the decoder's first input

    @property
    def vocab_size(self) -> int:
        """Number of ids, specials included: ids are in [0, vocab_size), on both sides (one joint vocabulary)."""
        return self._processor.get_piece_size()

    src_vocab_size = tgt_vocab_size = vocab_size

    def encode(self, text: str, side: str = "source") -> list[int]:
        """Subword ids of one sentence, without BOS or EOS (see the module docstring for where they go); `side`
        ("source" or "target") does not matter to a joint vocabulary."""
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode takes one str, got {type(text).__name__}; use encode_batch")
        return self._processor.encode(text)

    def encode_batch(self, texts: Sequence[str], side: str = "source") -> list[list[int]]:
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

    def piece(self, index: int) -> str:
        """The subword string of one id."""
        return self._processor.IdToPiece(int(index))

    def pieces(self, text: str) -> list[str]:
        """The subword strings of `text` (for looking at what the tokenizer does)."""
        return self._processor.encode(text, out_type=str)


# =============================================================================================================
# The tokenizers of imported models, and reading any tokenizer back
# =============================================================================================================


class _Bundle:
    """A tokenizer made of files (an imported model's), serialised as one JSON object: its kind, its options and
    every file's bytes (base64), so a checkpoint carries it as it carries the SentencePiece model."""

    kind = "bundle"

    def __init__(self, files: dict[str, bytes], options: dict) -> None:
        self.files, self.options = dict(files), dict(options)

    def to_bytes(self) -> bytes:
        files = {name: base64.b64encode(data).decode("ascii") for name, data in sorted(self.files.items())}
        return json.dumps({"kind": self.kind, "options": self.options, "files": files}, sort_keys=True).encode()

    def save(self, path: str | os.PathLike) -> None:
        """Writes the bundle as one JSON file (the run directory's `tokenizer.model`)."""
        files.write_bytes(path, self.to_bytes())

    def decode_batch(self, rows: Iterable[Iterable[int]]) -> list[str]:
        return [self.decode(row) for row in rows]


class MarianTokenizer(_Bundle):
    """The tokenizer of transformers' MarianMTModel (OPUS-MT), without transformers: a SentencePiece model per
    side (`source.spm`, `target.spm`) whose pieces are mapped to ids by `vocab.json` (and `target_vocab.json` when
    the vocabularies are separate); an unknown piece is <unk>, a leading language code such as >>fr<< is a token
    of its own, and the literal strings of the special tokens (</s>, <unk>, <pad>) in a text are those tokens, as
    transformers' MarianTokenizer does. The decoder starts from <pad>."""

    kind = "marian"
    SPECIALS = ("</s>", "<unk>", "<pad>")

    def __init__(self, files: dict[str, bytes], options: dict | None = None) -> None:
        super().__init__(files, options or {})
        self.separate = bool(self.options.get("separate_vocabs", False))
        self.source_vocab = json.loads(files["vocab.json"])
        self.target_vocab = json.loads(files["target_vocab.json"]) if self.separate else self.source_vocab
        self.spm = {}
        for side, name in (("source", "source.spm"), ("target", "target.spm")):
            processor = spm.SentencePieceProcessor()
            processor.LoadFromSerializedProto(files[name])
            self.spm[side] = processor
        self.pad_id, self.eos_id = self.source_vocab["<pad>"], self.source_vocab["</s>"]
        self.unk_id = self.source_vocab["<unk>"]
        self.start_id = self.pad_id
        self._pieces = {index: piece for piece, index in self.target_vocab.items()}

    @property
    def src_vocab_size(self) -> int:
        return len(self.source_vocab)

    @property
    def tgt_vocab_size(self) -> int:
        return len(self.target_vocab)

    vocab_size = src_vocab_size

    def encode(self, text: str, side: str = "source") -> list[int]:
        vocab = self.source_vocab if side == "source" else self.target_vocab
        unk = vocab["<unk>"]
        ids: list[int] = []
        for chunk, special in _split_specials(text, self.SPECIALS):
            if special:
                ids.append(vocab[chunk])
                continue
            code = []
            if chunk.startswith(">>") and (end := chunk.find("<<")) != -1:  # a target-language code, e.g. >>fr<<
                code, chunk = [chunk[: end + 2]], chunk[end + 2 :]
            pieces = code + (self.spm[side].encode(chunk, out_type=str) if chunk else [])
            ids.extend(vocab.get(piece, unk) for piece in pieces)
        return ids

    def encode_batch(self, texts: Sequence[str], side: str = "source") -> list[list[int]]:
        return [self.encode(text, side) for text in texts]

    def piece(self, index: int, side: str = "target") -> str:
        """The vocabulary entry of `index` on one side ("<unk>" for an id outside it)."""
        return _piece(self, index, side)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a model output row (target side): stops at the first EOS, leaves out the special tokens."""
        pieces = []
        for i in (int(x) for x in ids):
            if i == self.eos_id:
                break
            piece = self._pieces.get(i) or self.spm["target"].IdToPiece(i) or "<unk>"
            if piece not in self.SPECIALS:
                pieces.append(piece)
        return self.spm["target"].decode_pieces(pieces).replace("\u2581", " ").strip()


class FsmtTokenizer(_Bundle):
    """The tokenizer of transformers' FSMT and of fairseq's translation models: Moses (sacremoses: punctuation
    normalised, tokenized with aggressive dash splits, HTML-escaped) then BPE with the model's merges, one vocabulary
    per side (fairseq's dictionaries: <s> 0, <pad> 1, </s> 2, <unk> 3). It needs sacremoses and, for the two Moses
    clean-up steps transformers ported from Moses' perl scripts, transformers' FSMT tokenizer module (the
    `pretrained` extra); the BPE is written out here. The decoder starts from </s>, as fairseq's does."""

    kind = "fsmt"
    SPECIALS = ("<s>", "</s>", "<unk>", "<pad>")

    def __init__(self, files: dict[str, bytes], options: dict | None = None) -> None:
        super().__init__(files, options or {})
        self.langs = list(self.options.get("langs", ["en", "de"]))
        self.lower = bool(self.options.get("do_lower_case", False))
        self.source_vocab = json.loads(files["vocab-src.json"])
        self.target_vocab = json.loads(files["vocab-tgt.json"])
        merges = [tuple(line.split()[:2]) for line in files["merges.txt"].decode("utf-8").splitlines() if line]
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.pad_id, self.eos_id, self.unk_id = (
            self.source_vocab.get(t, i) for t, i in (("<pad>", 1), ("</s>", 2), ("<unk>", 3))
        )
        self.start_id = self.eos_id
        self._pieces = {index: piece for piece, index in self.target_vocab.items()}
        self._moses = {}

    @property
    def src_vocab_size(self) -> int:
        return len(self.source_vocab)

    @property
    def tgt_vocab_size(self) -> int:
        return len(self.target_vocab)

    vocab_size = src_vocab_size

    def _tools(self, lang: str):
        if lang not in self._moses:
            try:
                import sacremoses
                from transformers.models.fsmt.tokenization_fsmt import remove_non_printing_char, replace_unicode_punct
            except ImportError as e:
                raise DataError(
                    f"the FSMT/fairseq tokenizer needs sacremoses and transformers ({e}): pip install "
                    f"-e '.[pretrained]'"
                ) from None
            normalize = sacremoses.MosesPunctNormalizer(lang=lang).normalize
            tokenize = sacremoses.MosesTokenizer(lang=lang).tokenize
            self._moses[lang] = (
                lambda text: tokenize(
                    remove_non_printing_char(normalize(replace_unicode_punct(text))),
                    aggressive_dash_splits=True,
                    return_str=False,
                    escape=True,
                ),
                sacremoses.MosesDetokenizer(lang=lang).detokenize,
            )
        return self._moses[lang]

    def bpe(self, token: str) -> list[str]:
        """The BPE pieces of one Moses token, merging the lowest-ranked pair first (the end of the word marked with
        </w>, as in the merges fairseq's fastBPE learned)."""
        word = list(token[:-1]) + [token[-1] + "</w>"]
        while len(word) > 1:
            pairs = {(a, b) for a, b in zip(word, word[1:])}
            best = min(pairs, key=lambda pair: self.ranks.get(pair, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        return word

    def encode(self, text: str, side: str = "source") -> list[int]:
        lang, vocab = (self.langs[0], self.source_vocab) if side == "source" else (self.langs[1], self.target_vocab)
        unk, ids = vocab.get("<unk>", self.unk_id), []
        for chunk, special in _split_specials(text, self.SPECIALS):
            if special:
                ids.append(vocab.get(chunk, unk))
                continue
            chunk = chunk.lower() if self.lower else chunk
            tokens = self._tools(lang)[0](chunk) if chunk else []
            ids.extend(vocab.get(piece, unk) for token in tokens if token for piece in self.bpe(token))
        return ids

    def encode_batch(self, texts: Sequence[str], side: str = "source") -> list[list[int]]:
        return [self.encode(text, side) for text in texts]

    def piece(self, index: int, side: str = "target") -> str:
        """The vocabulary entry of `index` on one side ("<unk>" for an id outside it)."""
        return _piece(self, index, side)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a model output row (target side): stops at the first EOS, leaves out the special tokens (as
        transformers' decode with skip_special_tokens), joins the BPE pieces and Moses-detokenizes."""
        pieces = []
        for i in (int(x) for x in ids):
            if i == self.eos_id:
                break
            piece = self._pieces.get(i, "<unk>")
            if piece not in self.SPECIALS:
                pieces.append(piece)
        words = "".join(piece.replace("</w>", " ") for piece in pieces).split()
        return self._tools(self.langs[1])[1](words)


class LanguageCodeTokenizer(_Bundle):
    """The tokenizers of multilingual models that mark a sentence with its language's code (NLLB-200, M2M-100,
    mBART-50), as transformers' tokenizers place them: a source is `[src_lang] pieces </s>` (the pipeline adds the
    </s>), a target `[tgt_lang] pieces </s>`; the model's first generated token is forced to `tgt_lang`'s code
    (`forced_bos_id`). Decoded text leaves out the special tokens and the codes. Subclasses read the files."""

    codes: dict[str, int]  # language code -> id

    def __init__(self, files: dict[str, bytes], options: dict) -> None:
        super().__init__(files, options)
        self.start_id = self.eos_id  # the decoder starts from </s>, as fairseq's do

    def checked_language(self, code: str | None, flag: str) -> str:
        """`code` if the tokenizer knows it, else a DataError naming `flag` and the closest valid codes."""
        import difflib

        if code is None:
            raise DataError(f"{flag} is needed: this model translates between {len(self.codes)} languages")
        if code not in self.codes:
            close = difflib.get_close_matches(code, list(self.codes), n=5, cutoff=0.4)
            known = f"closest: {', '.join(close)}" if close else f"e.g. {', '.join(list(self.codes)[:5])}"
            raise DataError(f"{flag} {code!r} is not a language code of this tokenizer ({known})")
        return code

    def with_languages(self, src_lang: str | None = None, tgt_lang: str | None = None) -> LanguageCodeTokenizer:
        """The same tokenizer for another pair of languages (None: keep the current one), each checked: a view that
        shares this one's files and models (a pair per request costs no parse of NLLB's 17 MB tokenizer.json)."""
        import copy

        options = dict(self.options)
        for key, code in (("src_lang", src_lang), ("tgt_lang", tgt_lang)):
            if code is not None:
                options[key] = self.checked_language(code, f"--{key.replace('_', '-')}")
        view = copy.copy(self)  # the languages are read from `options` when used, nothing else depends on them
        view.options = options
        return view

    @property
    def src_lang(self) -> str | None:
        return self.options.get("src_lang")

    @property
    def tgt_lang(self) -> str | None:
        return self.options.get("tgt_lang")

    @property
    def forced_bos_id(self) -> int:
        """The id the model must produce first: the target language's code."""
        return self.codes[self.checked_language(self.tgt_lang, "--tgt-lang")]

    def encode(self, text: str, side: str = "source") -> list[int]:
        code = self.src_lang if side == "source" else self.tgt_lang
        flag = "--src-lang" if side == "source" else "--tgt-lang"
        return [self.codes[self.checked_language(code, flag)]] + self.pieces_ids(text)

    def encode_batch(self, texts: Sequence[str], side: str = "source") -> list[list[int]]:
        return [self.encode(text, side) for text in texts]

    def encode_with_codes(self, texts: Sequence[str], codes: Sequence[str]) -> list[list[int]]:
        """Each text marked with its own language's code (a corpus of many language pairs); the codes checked
        by the caller (`checked_language`), where it knows each one's line."""
        return [[self.codes[code]] + self.pieces_ids(text) for text, code in zip(texts, codes)]

    def pieces_ids(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a model output row: stops at the first EOS, leaves out special tokens and language codes."""
        row = []
        for i in (int(x) for x in ids):
            if i == self.eos_id:
                break
            row.append(i)
        return self.decode_ids(row)

    def decode_ids(self, ids: list[int]) -> str:
        raise NotImplementedError


class TokenizersJsonTokenizer(LanguageCodeTokenizer):
    """NLLB-200's and mBART-50's tokenizers from their `tokenizer.json`, read by the `tokenizers` library (the one
    transformers runs for them): its normalizer, pre-tokenizer and model as saved, the language codes being its
    special added tokens. Decoding cleans up spaces before punctuation where transformers does (a Unigram model
    whose tokenizer_config.json asks `clean_up_tokenization_spaces`)."""

    kind = "tokenizers"
    OTHER_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")

    def __init__(self, files: dict[str, bytes], options: dict | None = None) -> None:
        try:
            from tokenizers import Tokenizer as Backend
        except ImportError as e:
            needs = f"this model's tokenizer needs the tokenizers library ({e})"
            raise DataError(f"{needs}: pip install -e '.[pretrained]'") from None
        try:
            self.backend = Backend.from_str(files["tokenizer.json"].decode("utf-8"))
        except Exception as e:  # noqa: BLE001 (tokenizers raises its own exception type for a bad file)
            raise DataError(f"tokenizer.json: not a tokenizer the tokenizers library reads: {e}") from None
        vocab = self.backend.get_vocab(with_added_tokens=True)
        self.pad_id, self.eos_id, self.unk_id = vocab["<pad>"], vocab["</s>"], vocab["<unk>"]
        added = self.backend.get_added_tokens_decoder()
        self.codes = {
            t.content: i for i, t in sorted(added.items()) if t.special and t.content not in self.OTHER_SPECIALS
        }
        self.size = self.backend.get_vocab_size(with_added_tokens=True)
        self.clean_up = bool((options or {}).get("clean_up_tokenization_spaces")) and (
            type(self.backend.model).__name__ != "BPE"
        )
        super().__init__(files, options or {})

    @property
    def src_vocab_size(self) -> int:
        return self.size

    tgt_vocab_size = vocab_size = src_vocab_size

    def pieces_ids(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def with_code(self, code: str) -> TokenizersJsonTokenizer:
        """The tokenizer with a new language code: a special added token of the next id in tokenizer.json, and
        one more entry of tokenizer_config.json's special-token lists (what transformers' NLLB and mBART-50
        tokenizers read their codes from)."""
        from tokenizers import AddedToken

        backend = type(self.backend).from_str(self.backend.to_str())
        backend.add_special_tokens([AddedToken(code, special=True, normalized=False)])
        files = {**self.files, "tokenizer.json": backend.to_str().encode("utf-8")}
        if "tokenizer_config.json" in files:
            settings = json.loads(files["tokenizer_config.json"])
            for key in ("extra_special_tokens", "additional_special_tokens"):
                if isinstance(settings.get(key), list):
                    settings[key] = [*settings[key], code]
            files["tokenizer_config.json"] = json.dumps(settings, indent=2).encode("utf-8")
        return type(self)(files, self.options)

    def piece(self, index: int, side: str = "target") -> str:
        return self.backend.id_to_token(int(index)) or "<unk>"

    def decode_ids(self, ids: list[int]) -> str:
        text = self.backend.decode(ids, skip_special_tokens=True)
        return _clean_up_tokenization(text) if self.clean_up else text


def _clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`: no space before punctuation and English contractions."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(spaced, joined)
    for suffix in ("m", "s", "ve", "re"):
        text = text.replace(f" '{suffix}", f"'{suffix}")
    return text


class M2M100Tokenizer(LanguageCodeTokenizer):
    """M2M-100's tokenizer: a SentencePiece model (`sentencepiece.bpe.model`) whose pieces map to ids by
    `vocab.json` (an unknown piece is <unk>), the language codes `__xx__` numbered after the vocabulary in the order
    of `options["language_codes"]` (transformers' list for "m2m100" or "wmt21", stored at import), and the literal
    strings of special tokens in a text read as those tokens, as transformers' M2M100Tokenizer does."""

    kind = "m2m_100"

    def __init__(self, files: dict[str, bytes], options: dict | None = None) -> None:
        options = options or {}
        try:
            self.vocab = json.loads(files["vocab.json"])
        except ValueError as e:
            raise DataError(f"vocab.json: not a JSON vocabulary: {e}") from None
        self.spm = spm.SentencePieceProcessor()
        try:
            self.spm.LoadFromSerializedProto(files["sentencepiece.bpe.model"])
        except Exception as e:  # noqa: BLE001 (sentencepiece raises RuntimeError or OSError)
            raise DataError(f"sentencepiece.bpe.model: not a SentencePiece model: {e}") from None
        self.pad_id, self.eos_id, self.unk_id = self.vocab["<pad>"], self.vocab["</s>"], self.vocab["<unk>"]
        codes = list(options.get("language_codes") or [])
        self.codes = {code: len(self.vocab) + i for i, code in enumerate(codes)}
        self.tokens = {f"__{code}__": i for code, i in self.codes.items()}
        self.specials = ("<s>", "<pad>", "</s>", "<unk>", *self.tokens)
        self._pieces = {index: piece for piece, index in self.vocab.items()}
        self._pieces.update({i: token for token, i in self.tokens.items()})  # the codes after the vocabulary
        # what decoded text leaves out: the special tokens and the codes
        self._unspoken = {self.vocab[t] for t in ("<s>", "<pad>", "</s>", "<unk>") if t in self.vocab}
        self._unspoken |= set(self.tokens.values())
        self.size = len(self.vocab) + len(codes)  # the ids it produces (the model's table has a few more)
        self.clean_up = bool(options.get("clean_up_tokenization_spaces"))
        super().__init__(files, options)

    @property
    def src_vocab_size(self) -> int:
        return self.size

    tgt_vocab_size = vocab_size = src_vocab_size

    def pieces_ids(self, text: str) -> list[int]:
        ids = []
        for chunk, special in _split_specials(text, self.specials):
            if special:
                ids.append(self.tokens.get(chunk, self.vocab.get(chunk)))
            elif chunk:
                ids.extend(self.vocab.get(piece, self.unk_id) for piece in self.spm.encode(chunk, out_type=str))
        return ids

    def piece(self, index: int, side: str = "target") -> str:
        return self._pieces.get(int(index), "<unk>")

    def decode_ids(self, ids: list[int]) -> str:
        pieces = [self._pieces.get(i, "<unk>") for i in ids if i not in self._unspoken]
        text = self.spm.decode_pieces(pieces).strip()
        return _clean_up_tokenization(text) if self.clean_up else text


def with_languages(tokenizer, src_lang: str | None = None, tgt_lang: str | None = None):
    """`tokenizer` for the languages given (`--src-lang`, `--tgt-lang`; None: as it is). A tokenizer without
    language codes takes none: a DataError saying so."""
    if src_lang is None and tgt_lang is None:
        return tokenizer
    if not isinstance(tokenizer, LanguageCodeTokenizer):
        raise DataError(
            f"--src-lang/--tgt-lang: this model's tokenizer ({tokenizer.kind}) has no language codes (a Marian "
            f"multilingual model takes its >>xx<< code at the start of each source line)"
        )
    return tokenizer.with_languages(src_lang, tgt_lang)


def _piece(tokenizer, index: int, side: str) -> str:
    if side == "target":
        return tokenizer._pieces.get(int(index), "<unk>")
    if not hasattr(tokenizer, "_source_pieces"):
        tokenizer._source_pieces = {i: piece for piece, i in tokenizer.source_vocab.items()}
    return tokenizer._source_pieces.get(int(index), "<unk>")


def _split_specials(text: str, specials: Sequence[str]) -> list[tuple[str, bool]]:
    """`text` cut around the literal special-token strings in it: [(chunk, is_special)], in order."""
    out, start = [], 0
    while True:
        hits = [(text.find(s, start), s) for s in specials if text.find(s, start) != -1]
        if not hits:
            break
        at, special = min(hits)
        if at > start:
            out.append((text[start:at], False))
        out.append((special, True))
        start = at + len(special)
    if start < len(text) or not out:
        out.append((text[start:], False))
    return out


KINDS = {
    "marian": MarianTokenizer,
    "fsmt": FsmtTokenizer,
    "tokenizers": TokenizersJsonTokenizer,
    "m2m_100": M2M100Tokenizer,
}


def load_tokenizer(data: bytes, source: str = "tokenizer"):
    """Any tokenizer from its bytes (`to_bytes`): a JSON bundle of an imported model's files, or a SentencePiece
    model (this project's own, and every checkpoint written before imported models existed)."""
    if data[:1] == b"{":
        try:
            bundle = json.loads(data)
            files = {name: base64.b64decode(value) for name, value in bundle["files"].items()}
            return KINDS[bundle["kind"]](files, bundle.get("options", {}))
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{source}: not a tokenizer bundle this project reads ({type(e).__name__}: {e})") from None
    return Tokenizer(data, source=source)
