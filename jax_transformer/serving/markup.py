"""Markup in the service: LibreTranslate's `format=html` and the native API's `"format": "html" | "xml"`. Each text
is read as `decoding.markup` reads a document (`markup.Prepared`: its blocks' sentences known before any is
translated), its sentences go through the model's batcher as one request's sentences (so the service's limits on a
request's sentences hold, and nothing compiles after ready), each with its word alignment where the service runs
an aligned decoding (`serve --allow alignments=true`; else the inline tags wrap whole sentences, as the report
says), and the text is rendered with its markup kept. A markup limit past (nesting, an attribute's size) is a
DataError naming the text, line and column: the application answers it 400.
"""

from __future__ import annotations

import asyncio
import dataclasses
import html
import re
from collections.abc import Sequence
from typing import Any

from jax_transformer.decoding import markup
from jax_transformer.serving.errors import HTTPError
from jax_transformer.settings.config import DecodeConfig

FORMATS = ("text", "html", "xml")
INLINE_CHARS = 2000  # texts up to this many characters are read and rendered on the event loop (as service's)
_TAG = re.compile(r"<[^>]*>")


def rules_for(kind: str, keep_attributes: bool = False) -> markup.Rules:
    """The rules of `kind` ("html" or "xml"), as `Translator.markup_rules` gives them (XML: XLIFF's elements)."""
    return markup.Rules.of(kind == "xml", keep_attributes)


def format_field(fields: dict, allowed: Sequence[str] = FORMATS) -> str:
    """The request's `format` ("text" where absent, "" or null, as LibreTranslate reads them), else a 400."""
    value = fields.get("format") or "text"
    if value not in allowed:
        said = ", ".join(repr(f) for f in allowed)
        raise HTTPError(400, f"format {value!r}: this service translates {said}")
    return value


def bool_field(fields: dict, name: str) -> bool:
    """true/false (JSON), or "true"/"false"/"1"/"0" from a form; absent: false."""
    value = fields.get(name, False)
    if isinstance(value, str) and name in getattr(fields, "texts", ()):
        if value.strip().lower() in ("true", "1", "false", "0", ""):
            return value.strip().lower() in ("true", "1")
    if not isinstance(value, bool):
        raise HTTPError(400, f"{name}: expected true or false, got {value!r}"[:200])
    return value


def visible_text(text: str) -> str:
    """The text a reader sees, roughly (tags removed, entities decoded): what language detection reads."""
    return html.unescape(_TAG.sub(" ", text))


def aligned_decoding(model, decode: DecodeConfig) -> DecodeConfig:
    """`decode` with word alignments where the service runs that decoding (compiled at start: `--allow
    alignments=true`); else `decode` as it is (sampling gives none: its tags wrap whole sentences)."""
    if decode.alignments or decode.do_sample:
        return decode
    aligned = dataclasses.replace(decode, alignments=True)
    return aligned if model.allowed.allows(aligned) else decode


def target_code(model, target: Any) -> str:
    """The code a `lang` attribute becomes: the request's target as clients name it (ISO 639-1 where one maps)."""
    languages = model.languages
    code = languages.code(target, "target", "target") if target is not None else languages.targets[0]
    return languages.short([code])[0]


async def translate(
    model, texts: list[str], decode: DecodeConfig, pair, *, rules: markup.Rules, target_language: str | None,
    field: str, one: bool,
) -> list[tuple[str, markup.MarkupReport, list]]:  # fmt: skip
    """Each text of markup translated: [(text, report, its sentences' `Translation`s)]. Every text is read first
    (a DataError names `field`, line and column), then all their sentences are one request to the batcher."""
    segmenter = model.segmenter(pair)
    small = sum(map(len, texts)) <= INLINE_CHARS  # a thread hop costs more than reading a small text

    def prepare() -> list[markup.Prepared]:
        kw = {"rules": rules, "segmenter": segmenter, "target_language": target_language}
        origins = [field] if one else [f"{field}[{i}]" for i in range(len(texts))]
        return [markup.Prepared(t, report=markup.MarkupReport(origin=o), **kw) for t, o in zip(texts, origins)]

    prepared = prepare() if small else await asyncio.to_thread(prepare)
    sentences = [s for p in prepared for s in p.sentences]
    results = await model.translate(sentences, decode, pair, split=False) if sentences else []
    found = [t for _, each in results for t in each]  # (one translation per sentence: each is a text of its own)
    tokenizer, config = model.batcher.tokenizer(pair), model.loaded.config

    def render() -> list[tuple[str, markup.MarkupReport, list]]:
        out, at = [], 0
        for p in prepared:
            mine = found[at : at + len(p.sentences)]
            at += len(p.sentences)
            aligned = [
                (t.text, markup.word_pairs(tokenizer, config, s, [*model.source_ids(pair, s), config.eos_id], t)
                 if decode.alignments else None)
                for s, t in zip(p.sentences, mine)
            ]  # fmt: skip
            out.append((p.render(aligned), p.report, mine))
        return out

    return render() if small else await asyncio.to_thread(render)
