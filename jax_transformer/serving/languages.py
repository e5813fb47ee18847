"""The languages a served model translates between, as clients name them: its own codes (NLLB's eng_Latn,
mBART-50's en_XX, M2M-100's en, or the one pair of a model without codes) and the BCP 47 tags LibreTranslate's
clients send ("en", "de-DE", "zh-Hant"), matched by `langcodes`; `Detector` guesses a text's language with
py3langid, whose model ships inside its package."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from jax_transformer.errors import ConfigError
from jax_transformer.serving.errors import EXTRA, HTTPError

# The tags clients send: a language, then a script and/or a region ("de", "zh-Hant", "pt_BR", "deu_Latn"). Nothing
# longer is read: langcodes keeps every tag it parses, so a client's text reaches it only in these few bounded parts.
_TAG = re.compile(r"([a-z]{2,3})(?:[-_]([a-z]{4}))?(?:[-_]([a-z]{2}|[0-9]{3}))?")


def iso_code(code: str) -> str | None:
    """The ISO 639-1 code (or 639-3 where there is none) of a model's language code: eng_Latn -> en, en_XX -> en,
    de -> de; None where langcodes reads none."""
    import langcodes

    try:
        return langcodes.Language.get(code.replace("_", "-").split("-")[0]).language
    except (ValueError, LookupError):
        return None


@functools.cache  # (a 2-3 letter subtag from a client: bounded)
def _language(subtag: str) -> str | None:
    """langcodes' language for a language subtag (deu -> de, iw -> he, tl -> fil), None for one that is not a
    language with a name (xx, qaa, und)."""
    import langcodes

    try:
        tag = langcodes.Language.get(subtag)
        if not tag.language or tag.language == "und" or tag.extlangs or not tag.is_valid():
            return None
    except (ValueError, LookupError):
        return None
    try:
        from language_data.names import code_to_names
    except ImportError:  # (names need the language_data package; without it, IANA's registry alone decides)
        return tag.language
    return tag.language if code_to_names(tag.language) else None


@functools.lru_cache(maxsize=4096)
def _script(language: str, region: str | None) -> str | None:
    """The script a language is written in (in a region) when the tag names none: zh-TW -> Hant, sr -> Cyrl."""
    import langcodes

    return langcodes.Language.make(language=language, territory=region).maximize().script


@functools.lru_cache(maxsize=4096)
def _same_language(given: str, model: str) -> bool:
    """Whether CLDR counts two languages as one (langcodes' distance 0): ar and NLLB's arb, fa and pes, zh and cmn."""
    import langcodes

    return given == model or langcodes.tag_distance(given, model) == 0


def _is_language(code: str) -> bool:
    """Whether `code` is a BCP 47 tag (or a model-style code, _ for -) of a language langcodes knows by name."""
    import langcodes

    try:
        tag = langcodes.Language.get(code.replace("_", "-"))
    except (ValueError, LookupError):
        return False
    return bool(tag.language) and not tag.extlangs and tag.is_valid() and _language(tag.language) is not None


class Languages:
    """The languages a model translates between: its own codes (a multilingual tokenizer's, or the one pair of a
    model without codes), each also reachable by its ISO 639-1 code (the first model code of a language wins, e.g.
    zho_Hans for "zh"; the model's own codes are always accepted) and by the BCP 47 tags clients send (`code`)."""

    def __init__(self, sources: Sequence[str], targets: Sequence[str], multilingual: bool) -> None:
        import langcodes

        self.sources, self.targets, self.multilingual = list(sources), list(targets), multilingual
        self.alias: dict[str, str] = {}
        self.read: dict[str, tuple[str, str | None]] = {}  # model code -> language and script of its maximized tag
        for code in dict.fromkeys([*sources, *targets]):
            short = iso_code(code)
            if short and short not in self.alias:
                self.alias[short] = code
            try:
                tag = langcodes.Language.get(code.replace("_", "-"))
            except (ValueError, LookupError):
                continue
            if tag.language:
                self.read[code] = (tag.language, tag.maximize().script)

    @classmethod
    def of(cls, loaded, pair: str | None) -> Languages:
        tokenizer = loaded.tokenizer
        if hasattr(tokenizer, "codes"):
            codes = list(tokenizer.codes)
            return cls(codes, codes, True)
        src, tgt = _pair(loaded, pair)
        return cls([src], [tgt], False)

    def code(self, given: Any, field: str, side: str) -> str:
        """The model's code for `given` (its own, an ISO code or a BCP 47 tag: `match`), else HTTPError 400 naming
        the field and the closest codes."""
        known = self.sources if side == "source" else self.targets
        if not isinstance(given, str) or not given:
            raise HTTPError(400, f"Invalid request: missing {field} parameter")
        code = self.match(given, known)
        if code is None:
            import difflib

            candidates = list(dict.fromkeys([*(iso for iso, code in self.alias.items() if code in known), *known]))
            by_lower: dict[str, str] = {}  # (matched in any case, as `match` reads them; the first spelling wins)
            for candidate in candidates:
                by_lower.setdefault(candidate.lower(), candidate)
            close = [by_lower[c] for c in difflib.get_close_matches(given.lower(), by_lower, n=5, cutoff=0.4)]
            listed = dict.fromkeys(close or self.short(known))
            hint = f" (closest: {', '.join(listed)})" if close else f" (this model: {', '.join(listed)})"
            raise HTTPError(400, f"{field} {given!r} is not a {side} language of this model{hint}")
        return code

    def match(self, given: str, known: Sequence[str]) -> str | None:
        """The code among `known` that `given` names, any case, _ or -: the model's own code (mBART's de_DE, pt_XX);
        a bare language (de, DE, deu, zh) is the model's first code of it, as `short` lists it; otherwise the
        language and script of the maximized tag (langcodes' maximize: zh-TW is zh-Hant, pt-BR is pt-Latn) pick a
        code of that language and script, else of that language in another script; a language CLDR counts as
        the same (ar for NLLB's arb_Arab) comes after the language itself. Among equals the model's first code
        wins. None when no code fits."""
        if given in known:
            return given
        folded = given.lower().replace("-", "_")
        exact = next((code for code in known if code.lower().replace("-", "_") == folded), None)
        if exact is not None:
            return exact
        parts = _TAG.fullmatch(given.lower())
        language = _language(parts[1]) if parts else None
        if language is None:
            return None
        script, region = (parts[2] or "").title() or None, parts[3]
        if script is None and region is None and self.alias.get(language) in known:
            return self.alias[language]
        ranked = [
            (0 if read[0] == language else 1, code)
            for code in known
            if (read := self.read.get(code)) and _same_language(language, read[0])
        ]
        if not ranked:
            return None
        script = script or _script(language, region.upper() if region else None)
        ranked = [((self.read[code][1] != script, other), i, code) for i, (other, code) in enumerate(ranked)]
        return min(ranked)[2]

    def short(self, codes: Sequence[str]) -> list[str]:
        """The codes as clients see them: ISO where one maps back to the code, else the model's own."""
        out = []
        for code in codes:
            iso = iso_code(code)
            out.append(iso if iso and self.alias.get(iso) == code else code)
        return out

    def listing(self) -> list[dict[str, Any]]:
        """LibreTranslate's /languages: [{"code", "name", "targets"}] per source language."""
        import langcodes

        targets = self.short(self.targets)
        out = []
        for code, short in zip(self.sources, self.short(self.sources)):
            try:
                name = langcodes.Language.get(code.replace("_", "-")).display_name()
            except (ValueError, LookupError, ImportError):  # (names need the language_data package)
                name = code
            out.append({"code": short, "name": name, "targets": [t for t in targets if t != short]})
        return out


def _pair(loaded, given: str | None) -> tuple[str, str]:
    """The (source, target) codes of a model without language codes: --languages, else what its run says."""
    if given:
        return _given_pair(given)
    from jax_transformer.checkpoint.settings import stored_settings
    from jax_transformer.settings.config import DataConfig

    settings = stored_settings(loaded)
    if DataConfig.from_dict(settings.get("data", {})).uses_default_task and not settings.get("imported_from"):
        return "en", "fr"  # the built-in task: English number words to French
    name = str((loaded.run or {}).get("imported_from", {}).get("source", ""))
    if "opus-mt-" in name:  # Helsinki-NLP/opus-mt-de-en
        parts = name.rsplit("opus-mt-", 1)[1].split("-")
        if len(parts) == 2:
            return parts[0], parts[1]
    raise ConfigError(
        "serve: this model has no language codes and its languages are not known from its run; give them, e.g. "
        "--languages de-en"
    )


def _given_pair(given: str) -> tuple[str, str]:
    """--languages SRC-TGT, each side a language langcodes knows, so that a typo (xx-yy) stops the start rather than
    naming the model's languages wrongly to every client. A side may be a tag ("pt-BR-en"): the split is where both
    sides are languages, a side never starting with a capital in mixed case (de-CH-fr), else a _ decides (de_ch-fr)."""
    parts = given.split("-")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"--languages {given!r}: expected SRC-TGT, e.g. de-en")
    splits = [("-".join(parts[:i]), "-".join(parts[i:])) for i in range(1, len(parts))]
    if not given.isupper() and not given.islower():  # in mixed case, a capital starts a region or a script
        splits = [split for split in splits if not any(side[:1].isupper() for side in split)] or splits
    faults = {split: [side for side in split if not _is_language(side)] for split in splits}
    fitting = [split for split in splits if not faults[split]]
    if not fitting:
        worst = min(splits, key=lambda split: (len(faults[split]), sum(map(len, faults[split]))))
        wrong = " and ".join(repr(side) for side in faults[worst])
        verb = "is not a language" if len(faults[worst]) == 1 else "are not languages"
        raise ConfigError(
            f"--languages {given!r}: {wrong} {verb} that langcodes knows; give BCP 47 codes, e.g. de-en or pt_BR-en"
        )
    if len(fitting) > 1:
        readings = " or ".join(f"{src} to {tgt}" for src, tgt in fitting)
        raise ConfigError(f"--languages {given!r} reads as {readings}; write a region with _, e.g. de_CH-fr")
    src, tgt = fitting[0]
    if _normal(src) == _normal(tgt):
        raise ConfigError(
            f"--languages {given!r}: the source {src!r} and the target {tgt!r} are the same language; give two, "
            "e.g. de-en"
        )
    return src, tgt


def _normal(code: str) -> str:
    """A tag as langcodes writes it, so that de and DE, pt_BR and pt-br compare equal."""
    import langcodes

    return str(langcodes.Language.get(code.replace("_", "-")))


class Detector:
    """A text's language among the model's source languages: py3langid (its model ships inside the package) with
    normalized probabilities; [(model code, confidence 0-100)], most likely first."""

    def __init__(self, languages: Languages) -> None:
        try:
            from py3langid.langid import MODEL_FILE, LanguageIdentifier
        except ImportError:
            raise ConfigError(f"language detection needs py3langid; install it with {EXTRA}") from None
        self.identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        self.codes = {iso: code for iso, code in languages.alias.items() if code in languages.sources}
        known = [iso for iso in self.codes if iso in self.identifier.nb_classes]
        if not known:
            shown = ", ".join(languages.short(languages.sources[:8])) + ", ..." * (len(languages.sources) > 8)
            raise ConfigError(
                f"language detection: none of this model's source languages ({shown}) is one py3langid knows"
            )
        self.identifier.set_languages(known)

    def detect(self, text: str, n: int = 3) -> list[tuple[str, float]]:
        ranked = self.identifier.rank(text)[:n]
        return [(self.codes[iso], round(100.0 * float(p), 2)) for iso, p in ranked]


def detector_for(languages: Languages) -> tuple[Detector | None, str]:
    """The detector of a model's source languages, or None and why not in words, for the answer to a source of
    "auto" (py3langid missing and how to install it, or no source language that py3langid knows)."""
    try:
        return Detector(languages), ""
    except ConfigError as e:
        return None, str(e)
