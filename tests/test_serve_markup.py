"""HTML and XML through `train.py serve` (a child process on 127.0.0.1, as test_serve.py starts it): LibreTranslate's
`format=html` as its clients post it, and the native API's `"format"` with the markup's report, each the text
`Translator.translate_markup` gives with the same model and decoding; a malformed text's repairs in the report, a
markup limit and the service's sentence limit answered with an error naming them, and nothing compiled after
ready. In process: a service that runs no aligned decoding wraps each sentence in its tags. The trained tiny model
(tests/data) decodes, so the translations are the same on every CPU. A bounded number of requests, to loopback
only."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tests.helpers.saved import saved_run
from tests.test_serve import Server

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

KEY = "markup-key"
MAX_QUEUE = 24  # sentences one request may hold (the queue's size)
HTML = "<p>one hundred and <b>twenty</b></p>\n<ul><li>two hundred and <i>forty</i><li>three hundred and five</ul>"
BROKEN = "<p>one hundred <b>and eleven</p> two hundred and nine</i></p>"
XML = '<doc><seg xml:lang="en">one hundred and <g id="1">twenty</g></seg></doc>'


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return saved_run(tmp_path_factory.mktemp("serve-markup") / "run")


@pytest.fixture(scope="module")
def server(run, tmp_path_factory):
    key = tmp_path_factory.mktemp("key") / "key"
    key.write_text(KEY + "\n")
    # Alignments allowed: the markup's requests ask for them, so the tags are placed on the words they wrapped.
    found = Server(["--checkpoint", str(run), "--step", "latest", "--api-key-file", str(key), "--beam-size", "2",
                    "--max-tokens", "64", "--max-request-bytes", "4000", "--max-queue", str(MAX_QUEUE),
                    "--allow", "alignments=true"])  # fmt: skip
    yield found
    assert found.stop() == 0, "".join(found.log)


@pytest.fixture(scope="module")
def translator(run):
    from jax_transformer.decoding.translator import Translator

    return Translator(run, "latest", beam_size=2)


def form(server: Server, fields: dict) -> tuple[int, dict]:
    """A form post to /translate, as libretranslatepy's `translate` posts its fields (it sends no `format`)."""
    data = urllib.parse.urlencode({**fields, "api_key": KEY}).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(server.url + "/translate", data=data), timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.slow  # (a server in a child process compiles its programs first)
def test_html_through_libretranslates_form_and_the_native_api_is_translate_markups(server, translator):
    from jax_transformer.decoding.markup import MarkupReport

    report = MarkupReport()
    expected = translator.translate_markup(HTML, target_language="fr", report=report)
    assert expected.count("<b>") == expected.count("</b>") == 1 and "<ul><li>" in expected and "<i>" in expected
    assert report.placed == 2 and report.unplaced_count == report.unaligned == 0  # by alignments the service runs
    status, answer = form(server, {"q": HTML, "source": "en", "target": "fr", "format": "html"})
    assert status == 200 and answer == {"translatedText": expected}, answer
    status, answer = form(server, {"q": HTML, "source": "auto", "target": "fr", "format": "html"})  # (tags removed)
    assert status == 200 and answer["translatedText"] == expected and answer["detectedLanguage"]["language"] == "en"
    status, answer = server.request(
        "/translate", {"q": [HTML, XML], "source": "en", "target": "fr", "format": "html", "api_key": KEY}
    )
    assert status == 200 and answer["translatedText"][0] == expected, answer

    broken_report = MarkupReport()
    broken = translator.translate_markup(BROKEN, target_language="fr", report=broken_report)
    xml = translator.translate_markup(XML, xml=True, target_language="fr")
    assert 'xml:lang="fr"' in xml and '<g id="1">' in xml
    status, answer = server.request("/v1/translate", {"text": [HTML, BROKEN], "format": "html", "api_key": KEY})
    assert status == 200, answer
    (plain, repaired) = answer["translations"]
    assert plain["text"] == expected and plain["markup"]["placed"] == report.placed
    assert repaired["text"] == broken and repaired["markup"]["repair_count"] == broken_report.repair_count >= 2
    assert repaired["markup"]["repairs"] == [str(n) for n in broken_report.repairs]
    assert repaired["markup"]["origin"] == "text[1]" and "line 1, column" in repaired["markup"]["repairs"][0]
    assert all(h["alignment"] for t in answer["translations"] for s in t["sentences"] for h in s["hypotheses"])
    status, answer = server.request("/v1/translate", {"text": XML, "format": "xml", "api_key": KEY})
    assert status == 200 and answer["translations"][0]["text"] == xml, answer
    status, health = server.request("/health", method="GET")
    assert status == 200 and health["compilations_after_ready"] == 0, health


@pytest.mark.slow
@pytest.mark.parametrize(
    "path, body, status, message",
    [
        ("/translate", {"q": "<b>" * 600 + "one", "format": "html"}, 400, "q, line 1, column 1537: <b> is nested"),
        ("/v1/translate", {"text": ["one", "<i>" * 600], "format": "html"}, 400, "text[1], line 1, column 1537"),
        ("/v1/translate", {"text": "<b>" * 600, "format": "html"}, 400, "over the limit of 512"),
        ("/translate", {"q": "<p>one</p>" * (MAX_QUEUE + 1), "format": "html"}, 413, f"more than this service "
                                                                                      f"queues ({MAX_QUEUE})"),
        ("/translate", {"q": "<b>one</b>", "format": "html", "alternatives": 1}, 400, "alternatives 1: not taken"),
        ("/translate", {"q": "<b>one</b>", "format": "xml"}, 400, "format 'xml': this service translates 'text'"),
        ("/v1/translate", {"text": "<b>one</b>", "format": "rtf"}, 400, "format 'rtf'"),
        ("/v1/translate", {"text": "<b>one</b>", "format": "html", "constraints": ["un"]}, 400, "constraints: not"),
        ("/v1/translate", {"text": "one", "format": "html", "keep_attributes": "yes"}, 400, "keep_attributes: "),
    ],
)  # fmt: skip
def test_markup_limits_and_refusals_name_what_is_at_fault(server, path, body, status, message):
    body = {"api_key": KEY, **({"source": "en", "target": "fr"} if path == "/translate" else {}), **body}
    got, answer = server.request(path, body)
    assert got == status and message in answer["error"], answer


def test_without_aligned_decoding_the_tags_wrap_whole_sentences(run, translator):
    """A service not started with --allow alignments=true (in this process, its batcher decoding): each sentence's
    tags wrap its whole translation, as the core does with no pairs, and the report counts them as unaligned."""
    import asyncio

    from jax_transformer.decoding.markup import translate_markup_text
    from jax_transformer.serving import markup, service
    from jax_transformer.settings.config import ServeConfig

    served = service.build(translator, ServeConfig(max_tokens=64), detect=False)
    model, pair = served.route("en", "fr")
    decode = markup.aligned_decoding(model, model.decode)
    assert not decode.alignments  # (not among the decodings this service runs)
    text = "<p>one hundred and <b>twenty</b></p><p><i>two</i> hundred and nine</p>"
    plain = lambda sentences: [(t.text, None) for t in translator.translate(sentences)]  # noqa: E731
    expected, report = translate_markup_text(text, plain, segmenter=translator.segmenter(), target_language="fr")
    model.batcher.start()
    try:
        ((got, got_report, found),) = asyncio.run(
            markup.translate(model, [text], decode, pair, rules=markup.rules_for("html"), target_language="fr",
                             field="q", one=True)
        )  # fmt: skip
    finally:
        model.batcher.close(10)
    assert got == expected and "<p><b>" in got and "</b></p><p><i>" in got
    assert got_report.unaligned == report.unaligned == 2 == len(found) and got_report.placed == 0
