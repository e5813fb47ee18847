"""The front door for Python users: a model loaded once, then asked to translate, score and translate documents, as
CTranslate2's `Translator` and transformers' `pipeline` are used.

    from jax_transformer import Translator

    translator = Translator("runs/nllb", src_lang="eng_Latn", tgt_lang="deu_Latn")
    results = translator.translate(["The cat sleeps.", "Hello!"], beam_size=4, n_best=2)
    results[0].hypotheses[1].text, results[0].hypotheses[1].score, results[0].hypotheses[1].tokens
    translator.score(["The cat sleeps."], ["Die Katze schläft."])[0].score   # log P, EOS included
    translator.translate_document("First sentence. Second one.\n\nA new paragraph.")
    translator.translate_markup('<p>The <b>red</b> car.</p>')   # HTML: inline tags placed by word alignments

The command line's `translate`, `score` and `translate --document`, and `serve`, go through the same methods (or,
for the service's batches, `translation.translations` beneath them), so a notebook gets what the command line
writes. Several runs decode as an ensemble (`decoding.ensemble`: their distributions combined at every step):
`Translator(["runs/a", "runs/b"], weights=[0.6, 0.4])`. Decoding options are `DecodeConfig`'s fields: given to the
constructor they replace the run's stored choice for every call, given to a call they apply to that call alone
(`settings.resolve` decides either way).
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tqdm.auto import tqdm

from jax_transformer.checkpoint.manager import Checkpoint
from jax_transformer.decoding import documents, loading, markup, scoring, translation
from jax_transformer.errors import UsageError
from jax_transformer.settings.config import DecodeConfig, check_decoding
from jax_transformer.settings.resolve import request_decoding


class Translator:
    """A run directory's model (trained here, or `train.py import`ed) loaded to decode.

    path, step: the run directory (or its checkpoints folder) and which checkpoint: "best", "latest" or a number.
        A list of run directories: an ensemble of their checkpoints (each at `step`), which must share the
        vocabulary; it decodes as the first run stored, and scores nothing (`score` is one model's).
    weights: an ensemble's weights, one per run (default: equal; normalised to sum to 1).
    src_lang, tgt_lang: a multilingual model's languages (NLLB's eng_Latn, mBART's en_XX; default: the tokenizer's).
    dtype, attention_kernel, quantize: how to compute ("bfloat16", "xla", "int8", ...), the model unchanged.
    mesh: the weights read straight onto a mesh of the devices ("data=8", "fsdp=4"), for a model one device cannot
        hold or for batches split over devices.
    print_fn: where the one line saying what was loaded goes (default: nowhere).
    **decoding: DecodeConfig fields (beam_size, n_best, do_sample, ...) over the run's stored decoding.
    """

    def __init__(
        self,
        path: str | os.PathLike | Sequence[str | os.PathLike],
        step: str | int = "best",
        *,
        weights: Sequence[float] | None = None,
        src_lang: str | None = None,
        tgt_lang: str | None = None,
        dtype: str | None = None,
        attention_kernel: str | None = None,
        quantize: str | None = None,
        mesh: str | None = None,
        print_fn: Callable[[str], None] | None = None,
        **decoding: Any,
    ) -> None:
        compute = {"dtype": dtype, "attention_kernel": attention_kernel, "quantize": quantize}
        languages = {"src_lang": src_lang, "tgt_lang": tgt_lang}
        paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
        if weights is not None and len(paths) == 1:
            raise UsageError("weights are an ensemble's: give several runs, or no weights")
        members = [
            loading.load(
                one,
                step,
                compute={k: v for k, v in compute.items() if v is not None},
                mesh=mesh,
                languages={k: v for k, v in languages.items() if v is not None},
                print_fn=print_fn,
            )
            for one in paths
        ]
        decode = loading.decoding(members[0], decoding)
        ensemble = loading.ensemble(members, weights) if len(members) > 1 else None
        if ensemble is not None:  # against the ensemble's limits too (the shortest max_len)
            check_decoding(ensemble.config, decode, {"beam_size": [decode.beams]})
        self._set(members[0], decode, ensemble)

    @classmethod
    def of(cls, loaded: Checkpoint, decode: DecodeConfig, ensemble=None) -> Translator:
        """A Translator of a checkpoint loaded already (`loading.load`), decoding as `decode` says (the command
        line loads with its flags, then hands the model here); `ensemble` (`loading.ensemble`, whose first member
        is `loaded`): decode with it instead."""
        translator = cls.__new__(cls)
        translator._set(loaded, decode, ensemble)
        return translator

    def _set(self, loaded: Checkpoint, decode: DecodeConfig, ensemble=None) -> None:
        import dataclasses

        from jax_transformer.decoding.decoders import on_device

        # The weights on the device once: a call on a checkpoint's numpy arrays copies them all in each time.
        self.loaded, self.decode = loaded.with_params(on_device(loaded.params)), decode
        self.ensemble = None if ensemble is None else dataclasses.replace(ensemble, params=on_device(ensemble.params))

    # --- what was loaded ------------------------------------------------------------------------------------

    @property
    def config(self):
        """The model's TransformerConfig, as it computes (an ensemble's: its `EnsembleConfig`)."""
        return self.loaded.config if self.ensemble is None else self.ensemble.config

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def params(self):
        return self.loaded.params if self.ensemble is None else self.ensemble.params

    @property
    def served(self) -> Checkpoint:
        """What a service decodes with: the checkpoint, or an ensemble's first run holding the ensemble's config and
        weights (its tokenizer and languages are the members' shared ones)."""
        if self.ensemble is None:
            return self.loaded
        return dataclasses.replace(self.loaded.with_params(self.ensemble.params), config=self.ensemble.config)

    def _one_model(self, what: str) -> None:
        if self.ensemble is not None:
            raise UsageError(f"{what} takes one model, not an ensemble of {len(self.ensemble.names)} checkpoints")

    def decoding(self, **options: Any) -> DecodeConfig:
        """The decoding of one call: `options` (DecodeConfig's fields) over this translator's, checked against the
        model (a ConfigError naming the option otherwise)."""
        return request_decoding(self.config, self.decode, options, field="options")

    def __repr__(self) -> str:
        if self.ensemble is not None:
            names, weights = list(self.ensemble.names), list(self.ensemble.weights)
            return f"Translator({names!r}, weights={weights}, {self.decode.describe()})"
        return f"Translator({str(self.loaded.directory)!r}, step={self.loaded.step}, {self.decode.describe()})"

    # --- sentences ------------------------------------------------------------------------------------------

    def translate(
        self,
        sentences: Sequence[str],
        *,
        prefixes: Sequence[str | None] | None = None,
        constraints: Sequence[Sequence[str] | None] | None = None,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        progress: bool = False,
        **options: Any,
    ) -> list[translation.Translation]:
        """A `Translation` per sentence, in order: its hypotheses best first (`n_best` of them), each with its text,
        tokens, score and per-token log-probs. `prefixes`: text each translation must begin with (None: none).
        `constraints`: phrases each translation must hold, a list (or None) per sentence (`constraint_order`:
        "unordered" or "ordered"). Batches of `batch_size` sentences or `max_tokens` token slots (default 64)."""
        return translation.translations(
            self.params,
            self.config,
            self.tokenizer,
            list(sentences),
            self.decoding(**options),
            prefixes=prefixes,
            batch_size=batch_size,
            max_tokens=max_tokens,
            progress=progress,
            constraints=constraints,
        )

    def translate_lines(
        self, lines: Iterable[str], write: Callable[[str], None], *, decode: DecodeConfig | None = None, **kwargs
    ) -> translation.TranslationReport:
        """`translation.translate_lines` with this model: lines of any count, streamed, one output record per input
        line (`output_format` text, tsv or jsonl), `on_too_long` error or truncate. `decode`: this translator's
        decoding unless given."""
        return translation.translate_lines(
            self.params, self.config, self.tokenizer, lines, write, decode or self.decode, **kwargs
        )

    # --- scores ---------------------------------------------------------------------------------------------

    def score(
        self,
        sources: Sequence[str],
        targets: Sequence[str],
        *,
        alignments: bool | None = None,
        alignment_layer: int | None = None,
        **kwargs,
    ) -> list[scoring.Score | None]:
        """The `Score` of each (source, target) pair: the sum of the target tokens' log-probs (EOS included), the
        tokens and each one's log-prob, as CTranslate2's score_batch gives them (on_too_long="skip": None for a
        pair longer than the model takes, else a DataError naming it); with `alignments`, each pair's word
        alignment by `alignment_layer`'s cross-attention (None: this translator's, by default the last layer)."""
        self._one_model("scoring")
        given = {"alignments": alignments, "alignment_layer": alignment_layer}
        layer = self.decoding(**{k: v for k, v in given.items() if v is not None}).aligned_layer(self.config)
        return scoring.score_pairs(
            self.params, self.config, self.tokenizer, list(sources), list(targets), alignment_layer=layer, **kwargs
        )

    def score_lines(
        self, pairs: Iterable[tuple[int, str, str]], write: Callable[[str], None], **kwargs
    ) -> scoring.ScoreReport:
        """`scoring.score_lines` with this model: (line, source, target) pairs streamed, a record per line
        (`on_too_long` error or skip; `alignment_layer`: word alignments by that layer's cross-attention)."""
        self._one_model("scoring")
        return scoring.score_lines(self.params, self.config, self.tokenizer, pairs, write, **kwargs)

    # --- documents ------------------------------------------------------------------------------------------

    def segmenter(self, language: str | None = None) -> documents.Segmenter:
        """The sentence splitter of a document in `language` (ISO 639-1 or a model's code; default: the source
        language of a multilingual model, else English), which cuts sentences longer than the model takes."""
        language = language or getattr(self.tokenizer, "src_lang", None)
        return documents.Segmenter(language, documents.model_fits(self.tokenizer, self.config))

    def translate_document(self, text: str, *, language: str | None = None, **options: Any) -> str:
        """`text` translated as a document: each sentence replaced by its best translation, every space, tab, line
        break and blank line kept."""
        written: list[str] = []
        self.translate_stream(io.BytesIO(text.encode("utf-8")), written.append, language=language, **options)
        return "".join(written)

    # --- markup ---------------------------------------------------------------------------------------------

    def markup_rules(self, xml: bool = False, keep_attributes: bool = False, inline_elements=None,
                     opaque_elements=None) -> markup.Rules:  # fmt: skip
        """The rules of HTML, or of XML (`inline_elements`, `opaque_elements`: default XLIFF's)."""
        return markup.Rules.of(xml, keep_attributes, inline_elements, opaque_elements)

    def target_code(self, given: str | None = None) -> str | None:
        """The code a lang attribute becomes: `given`, else a multilingual model's target language (ISO 639-1)."""
        if given:
            return given
        code = getattr(self.tokenizer, "tgt_lang", None)
        return documents.splitter_language(code) if code else None

    def translate_markup(self, text: str, *, xml: bool = False, report: markup.MarkupReport | None = None,
                         **options: Any) -> str:  # fmt: skip
        """HTML (or XML) translated with its markup kept: each block's sentences translated, inline tags placed
        on the words that translate the words they wrapped (word alignments), every other character as it was.
        `report` (a `markup.MarkupReport`) gets what was repaired and which tags were not placed exactly."""
        written: list[str] = []
        found = self.translate_markup_stream(io.BytesIO(markup.write_bytes(text)), written.append, xml=xml, **options)
        if report is not None:
            report.__dict__.update(found.__dict__)
        return "".join(written)

    def translate_markup_stream(
        self,
        source,
        write: Callable[[str], None],
        *,
        xml: bool = False,
        keep_attributes: bool = False,
        inline_elements=None,
        opaque_elements=None,
        language: str | None = None,
        target_language: str | None = None,
        origin: str = "input",
        progress: bool | None = False,
        max_tokens: int | None = None,
        decode: DecodeConfig | None = None,
        glossary=None,
        **options: Any,
    ) -> markup.MarkupReport:
        """A document of markup of any size (a path or a binary stream, UTF-8) translated and written as it goes
        (`markup.translate_markup`); its sentences with word alignments where the decoding gives them."""
        decode = decode or self.decoding(**options)
        markup.check_usage("xml" if xml else "html", "text", decode.n_best)
        rules = self.markup_rules(xml, keep_attributes, inline_elements, opaque_elements)
        report = markup.MarkupReport(origin=origin)
        translate = markup.aligned_translator(self.params, self.config, self.tokenizer, decode, glossary=glossary,
                                              max_tokens=max_tokens)  # fmt: skip
        bar = tqdm(desc="translate", unit="sentence", disable=None if progress is None else not progress,
                   dynamic_ncols=True)  # fmt: skip

        def counted(sentences: list[str]):
            done = translate(sentences)
            bar.update(len(sentences))
            return done

        with bar:
            return markup.translate_markup(
                markup.read_markup(source, report, max_bytes=rules.max_bytes),
                write,
                counted,
                rules=rules,
                segmenter=self.segmenter(language),
                target_language=self.target_code(target_language),
                report=report,
            )

    def translate_stream(
        self,
        source,
        write: Callable[[str], None],
        *,
        language: str | None = None,
        origin: str = "input",
        progress: bool | None = False,
        max_tokens: int | None = None,
        decode: DecodeConfig | None = None,
        glossary=None,
        **options: Any,
    ) -> documents.DocumentReport:
        """A document of any size (a path or a binary stream, UTF-8) translated and written as it goes, in bounded
        memory (`documents.translate_document`). One translation of each sentence: an n-best decoding is refused.
        `glossary` (a `glossary.Glossary`): each sentence's translation holds the target terms of its source terms."""
        decode = decode or self.decoding(**options)
        if decode.n_best > 1:
            raise UsageError(
                f"a document takes one translation of each sentence: this decoding's n_best is {decode.n_best} "
                f"(give n_best=1, --n-best 1)"
            )
        return documents.translate_document(
            self.params,
            self.config,
            self.tokenizer,
            documents.read_blocks(source, origin=origin),
            write,
            decode,
            segmenter=self.segmenter(language),
            origin=origin,
            progress=progress,
            max_tokens=max_tokens,
            glossary=glossary,
        )
