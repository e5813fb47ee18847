"""The language codes of `serve`, without a server or a model: the BCP 47 tags LibreTranslate's clients send mapped
to NLLB's, mBART-50's and M2M-100's codes, the hint of a code that fits none, the operator's --languages pair, and
why detection is off."""

from __future__ import annotations

import sys

import pytest

from jax_transformer.errors import ConfigError
from jax_transformer.serving.errors import EXTRA, HTTPError
from jax_transformer.serving.languages import Detector, Languages, _pair, detector_for

NLLB = ["eng_Latn", "deu_Latn", "zho_Hans", "zho_Hant", "por_Latn", "arb_Arab", "fra_Latn"]
MBART = ["en_XX", "de_DE", "zh_CN", "pt_XX", "fr_XX"]
M2M = ["en", "de", "zh", "pt", "fr"]


def multilingual(codes: list[str]) -> Languages:
    return Languages(codes, codes, multilingual=True)


@pytest.mark.parametrize(
    "given, nllb, mbart, m2m",
    [
        ("de-DE", "deu_Latn", "de_DE", "de"),
        ("de_de", "deu_Latn", "de_DE", "de"),
        ("DE", "deu_Latn", "de_DE", "de"),
        ("deu", "deu_Latn", "de_DE", "de"),
        ("zh-Hant", "zho_Hant", "zh_CN", "zh"),
        ("zh-TW", "zho_Hant", "zh_CN", "zh"),
        ("zh-hk", "zho_Hant", "zh_CN", "zh"),
        ("zh", "zho_Hans", "zh_CN", "zh"),
        ("zh-CN", "zho_Hans", "zh_CN", "zh"),
        ("zh-Hans", "zho_Hans", "zh_CN", "zh"),
        ("pt-BR", "por_Latn", "pt_XX", "pt"),
        ("PT_br", "por_Latn", "pt_XX", "pt"),
    ],
)
def test_bcp47_tags_map_to_each_models_codes(given, nllb, mbart, m2m):
    assert [multilingual(codes).code(given, "source", "source") for codes in (NLLB, MBART, M2M)] == [nllb, mbart, m2m]


def test_a_models_own_codes_are_taken_as_they_are_in_any_case():
    nllb, mbart = multilingual(NLLB), multilingual(MBART)
    assert [nllb.code(c, "target", "target") for c in ("zho_Hant", "ZHO_HANT", "deu-Latn")] == [
        "zho_Hant",
        "zho_Hant",
        "deu_Latn",
    ]
    assert [mbart.code(c, "target", "target") for c in ("de_DE", "pt_XX", "PT_XX", "en-xx")] == [
        "de_DE",
        "pt_XX",  # (XX: no region)
        "pt_XX",
        "en_XX",
    ]


def test_the_first_code_of_a_language_owns_its_bare_code_and_its_short_form():
    """A bare code is the first model code of its language (as /languages lists it) even where the maximized tag
    names another script: sr is Cyrillic to CLDR, yet this model lists srp_Latn as "sr"."""
    languages = multilingual(["srp_Latn", "srp_Cyrl", "zho_Hant", "zho_Hans"])
    assert languages.short(languages.sources) == ["sr", "srp_Cyrl", "zh", "zho_Hans"]
    assert [languages.code(c, "source", "source") for c in ("sr", "sr-Cyrl", "sr-RS", "zh", "zh-CN", "zh-Hant")] == [
        "srp_Latn",
        "srp_Cyrl",
        "srp_Cyrl",  # (Serbia writes Cyrillic)
        "zho_Hant",
        "zho_Hans",
        "zho_Hant",
    ]


def test_language_before_script_and_the_first_among_equals():
    # No code in the tag's script: the language alone decides; two codes alike: the model's first.
    assert multilingual(["eng_Latn", "srp_Cyrl"]).code("sr-Latn", "source", "source") == "srp_Cyrl"
    assert multilingual(["fr_XX", "en_GB", "en_US"]).code("en-AU", "source", "source") == "en_GB"
    # A language CLDR counts as the same: LibreTranslate's ar is NLLB's Standard Arabic (not the first, a dialect).
    assert multilingual(["acm_Arab", "arb_Arab"]).code("ar", "source", "source") == "arb_Arab"


def test_a_source_and_a_target_are_matched_on_their_own_side():
    languages = Languages(["de"], ["en"], multilingual=False)
    assert languages.code("de-AT", "source", "source") == "de" and languages.code("en-GB", "target", "target") == "en"
    with pytest.raises(HTTPError, match="target 'de-AT' is not a target language of this model .this model: en.$"):
        languages.code("de-AT", "target", "target")


@pytest.mark.parametrize("given", ["xx", "deu_Lat", "de-DE-1901-x", "en-", "und", "qaa", "english"])
def test_a_code_that_fits_none_is_a_400_naming_the_field(given):
    with pytest.raises(HTTPError) as raised:
        multilingual(NLLB).code(given, "target", "target")
    assert raised.value.status == 400 and "--" not in raised.value.message  # (the field, never a flag)
    assert raised.value.message.startswith(f"target {given!r} is not a target language of this model (")


@pytest.mark.parametrize("given", [None, "", 3])
def test_a_missing_code_is_a_400_naming_the_field(given):
    with pytest.raises(HTTPError, match="^Invalid request: missing target parameter$"):
        multilingual(NLLB).code(given, "target", "target")


def test_the_hint_lists_each_code_once():
    languages = Languages(["en"], ["en"], multilingual=False)  # its ISO code and its own code are one
    with pytest.raises(HTTPError) as raised:
        languages.code("enn", "source", "source")
    assert raised.value.message == "source 'enn' is not a source language of this model (closest: en)"
    languages = Languages(["de", "de"], ["en"], multilingual=False)
    with pytest.raises(HTTPError) as raised:
        languages.code("xyz", "source", "source")
    assert raised.value.message == "source 'xyz' is not a source language of this model (this model: de)"
    with pytest.raises(HTTPError, match=r"\(closest: deu_Latn, "):
        multilingual(NLLB).code("DEU_LAT", "source", "source")  # (any case, as it is matched)


class Untouchable:
    """A loaded model that fails the test when `_pair` looks at it."""

    def __getattr__(self, name):
        raise AssertionError(f"_pair read loaded.{name} though --languages was given")


@pytest.mark.parametrize(
    "given, pair",
    [
        ("de-en", ("de", "en")),
        ("DE-EN", ("DE", "EN")),
        ("pt-BR-en", ("pt-BR", "en")),
        ("en-pt-BR", ("en", "pt-BR")),
        ("zh-Hant-en", ("zh-Hant", "en")),
        ("de-CH-fr", ("de-CH", "fr")),  # (not de to Chamorro in France: a capital marks the region)
        ("de_ch-fr", ("de_ch", "fr")),
        ("en_GB-en_US", ("en_GB", "en_US")),
    ],
)
def test_the_operators_pair_is_read_without_the_model(given, pair):
    assert _pair(Untouchable(), given) == pair


@pytest.mark.parametrize(
    "given, message",
    [
        ("xx-yy", "--languages 'xx-yy': 'xx' and 'yy' are not languages that langcodes knows; give BCP 47 codes, e.g."),
        ("de-xx", "--languages 'de-xx': 'xx' is not a language"),
        ("qaa-en", "'qaa' is not a language"),
        ("und-en", "'und' is not a language"),
        ("pt-BR-xx", "--languages 'pt-BR-xx': 'xx' is not a language"),
        ("de", "--languages 'de': expected SRC-TGT, e.g. de-en"),
        ("de-", "expected SRC-TGT"),
        ("de-de", "--languages 'de-de': the source 'de' and the target 'de' are the same language; give two, e.g."),
        ("pt_BR-pt-br", "the source 'pt_BR' and the target 'pt-br' are the same"),
        ("de-ch-fr", "--languages 'de-ch-fr' reads as de to ch-fr or de-ch to fr; write a region with _, e.g."),
    ],
)
def test_a_wrong_pair_stops_the_start(given, message):
    with pytest.raises(ConfigError) as raised:
        _pair(None, given)
    assert message in str(raised.value)


def test_detection_says_why_it_is_off(monkeypatch):
    detector, reason = detector_for(multilingual(NLLB))
    assert isinstance(detector, Detector) and reason == ""
    assert detector.detect("Das ist ein kleines Haus am See.", 1)[0][0] == "deu_Latn"
    # Languages py3langid lacks (Klingon to Quenya): the reason is that, not a missing package.
    detector, reason = detector_for(Languages(["tlh"], ["qya"], multilingual=False))
    assert detector is None and reason == (
        "language detection: none of this model's source languages (tlh) is one py3langid knows"
    )
    monkeypatch.setitem(sys.modules, "py3langid.langid", None)  # (as if it were not installed)
    detector, reason = detector_for(multilingual(NLLB))
    assert detector is None and reason == f"language detection needs py3langid; install it with {EXTRA}"


def test_language_codes_map_between_the_model_and_libretranslate():
    from jax_transformer.serving.errors import HTTPError
    from jax_transformer.serving.languages import Languages

    codes = ["eng_Latn", "deu_Latn", "zho_Hans", "zho_Hant", "fra_Latn"]
    languages = Languages(codes, codes, multilingual=True)
    assert [languages.code(c, "source", "source") for c in ("de", "DE", "deu_Latn", "zh", "zho_Hant")] == [
        "deu_Latn",
        "deu_Latn",
        "deu_Latn",
        "zho_Hans",  # the first code of a language takes its ISO code
        "zho_Hant",
    ]
    listing = {entry["code"]: entry for entry in languages.listing()}
    assert listing["de"]["name"] == "German" and "zho_Hant" in listing and "de" not in listing["de"]["targets"]
    with pytest.raises(HTTPError, match="target 'deu_Lat' is not a target language of this model .closest: deu_Latn"):
        languages.code("deu_Lat", "target", "target")
