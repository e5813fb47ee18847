"""`train.py serve` over real HTTP on 127.0.0.1 (a child process, as a user starts it): LibreTranslate's API through
its own client package (libretranslatepy), the native endpoint with options and scores against `translations`,
the same text as `translate`, text with its layout kept, lexical constraints and a glossary (what `Translator`
gives, nothing compiled after ready), the documented errors, a full queue, a bounded load from
concurrent clients, and a SIGTERM that loses no accepted request. The trained tiny model (tests/data) decodes, so
the translations are the same on every CPU. Requests go to loopback only, a bounded number of them."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from jax_transformer.decoding import loading
from jax_transformer.decoding.translation import translations
from tests.helpers.saved import load_saved_model, saved_run
from tests.helpers.training import REPO, run_main

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytestmark = pytest.mark.slow  # (servers in child processes; the unit tests of languages: test_serve_languages.py)

KEY = "s3cret-key"
SENTENCES = list(load_saved_model("trained_tiny").source_texts[:12])
GLOSSARY = ("seven", "sept")  # (source term, target term) of the server's --glossary
assert not any(GLOSSARY[0] in s.split() for s in SENTENCES)


class Server:
    """`train.py serve ... --port 0` in a child process (through tests.helpers.serve_held when `hold` is given):
    its URL read from the line it prints once it listens."""

    def __init__(self, args: list[str], hold: Path | None = None) -> None:
        prefix = ["-m", "tests.helpers.serve_held", str(hold)] if hold else ["train.py"]
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu")
        self.process = subprocess.Popen(
            [sys.executable, *prefix, "serve", "--port", "0", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.url = None
        deadline = time.monotonic() + 180
        while self.url is None:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.process.kill()
                raise AssertionError("serve did not start:\n" + "".join(self.log)) from None
            if line.startswith("serving http://"):
                self.url = line.split()[1]
            elif line == "":
                raise AssertionError("serve exited:\n" + "".join(self.log))

    def _read(self) -> None:
        for line in self.process.stderr:
            self.log.append(line)
            self.lines.put(line)
        self.lines.put("")

    def request(self, path: str, body=None, *, method: str | None = None, headers=None) -> tuple[int, object]:
        """(status, decoded JSON) of one request; `body` a dict is sent as JSON, bytes as they are."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        kind = {"Content-Type": "application/json"} if isinstance(body, dict) else {}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={**kind, **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return saved_run(tmp_path_factory.mktemp("serve") / "run")


@pytest.fixture(scope="module")
def server(run, tmp_path_factory):
    key = tmp_path_factory.mktemp("key") / "key"
    key.write_text(KEY + "\n")
    glossary = key.with_name("terms.tsv")
    glossary.write_text(f"{GLOSSARY[0]}\t{GLOSSARY[1]}\n", encoding="utf-8")
    # A small budget (--max-tokens) and allowed set: the programs compiled at start stay few. Constraints of one
    # size, and a glossary whose one term occurs in none of SENTENCES (their translations are those of translate).
    found = Server(["--checkpoint", str(run), "--step", "latest", "--api-key-file", str(key), "--max-request-bytes",
                    "4000", "--beam-size", "2", "--max-tokens", "64", "--constraint-size", "2x4",
                    "--glossary", str(glossary)])  # fmt: skip
    yield found
    assert found.stop() == 0, "".join(found.log)


def translated(run, sentences, **decode) -> list[str]:
    """`train.py translate` of these sentences (one per line), in this process."""
    source = Path(run).parent / "source.txt"
    source.write_text("".join(s + "\n" for s in sentences), encoding="utf-8")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in decode.items()]
    code, out, err = run_main(
        ["translate", "--checkpoint", str(run), "--step", "latest", "--input", str(source), *flags]
    )
    assert code == 0, err
    return out.splitlines()


def test_libretranslate_clients_get_what_translate_gives(server, run):
    from libretranslatepy import LibreTranslateAPI

    client = LibreTranslateAPI(server.url, api_key=KEY)
    expected = translated(run, SENTENCES[:6], beam_size=2)
    assert [client.translate(s, "en", "fr") for s in SENTENCES[:6]] == expected
    assert client.languages() == [{"code": "en", "name": "English", "targets": ["fr"]}]
    # A list of texts, and a text of several lines and blank lines: each line its own translation, layout kept.
    status, answer = server.request("/translate", {"q": SENTENCES[:3], "source": "en", "target": "fr", "api_key": KEY})
    assert status == 200 and answer["translatedText"] == expected[:3]
    text = f"  {SENTENCES[0]}\n\n{SENTENCES[1]}\r\n\t{SENTENCES[2]}\n"
    status, answer = server.request("/translate", {"q": text, "source": "en", "target": "fr", "api_key": KEY})
    assert status == 200 and answer["translatedText"] == f"  {expected[0]}\n\n{expected[1]}\r\n\t{expected[2]}\n"


def test_the_native_endpoint_takes_every_option_and_gives_scores(server, run):
    loaded = loading.load(run, "latest")
    options = {"beam_size": 2, "n_best": 2, "alpha": 0.8}  # alpha: an argument of the programs, any value runs
    expected = translations(
        loaded.params,
        loaded.config,
        loaded.tokenizer,
        SENTENCES[:5],
        loading.decoding(loaded, options),
        progress=False,
    )
    status, answer = server.request("/v1/translate", {"text": SENTENCES[:5], "options": options, "api_key": KEY})
    assert status == 200, answer
    for got, want in zip(answer["translations"], expected):
        (sentence,) = got["sentences"]
        assert got["text"] == want.hypotheses[0].text and sentence["source"] == want.source
        assert [h["tokens"] for h in sentence["hypotheses"]] == [h.tokens for h in want.hypotheses]
        # The same program on the same inputs: scores equal up to float32 printing through JSON.
        assert [h["score"] for h in sentence["hypotheses"]] == pytest.approx(
            [h.score for h in want.hypotheses], abs=1e-6
        )
    # LibreTranslate's alternatives: the n-best list's other texts, none empty, none twice, none the translation.
    decode = loading.decoding(loaded, {"beam_size": 2, "n_best": 2})
    best = translations(loaded.params, loaded.config, loaded.tokenizer, SENTENCES[:1], decode, progress=False)[0]
    texts = [h.text for h in best.hypotheses]
    status, answer = server.request("/translate", {"q": SENTENCES[0], "source": "en", "target": "fr",
                                                   "alternatives": 1, "api_key": KEY})  # fmt: skip
    assert status == 200 and answer["translatedText"] == texts[0]
    assert answer["alternatives"] == [t for i, t in enumerate(texts) if i and t and t not in texts[:i]]


def test_constraints_and_the_glossary_give_what_translate_gives_and_compile_nothing(server, run):
    """The native endpoint's `constraints` (padded to the service's 2x4) and the glossary's terms (LibreTranslate's
    route too) give the tokens of `Translator.translate` with the same phrases (padded to the smallest size that
    fits: the search is the same); constrained and plain requests compile nothing after ready."""
    from jax_transformer.decoding.translator import Translator

    translator = Translator(run, "latest", beam_size=2)
    texts = SENTENCES[:3]
    phrases = [["trois"], None, ["cent", "vingt"]]  # "trois" is not in the plain translation of "... and two"
    expected = translator.translate(texts, constraints=phrases)
    plain = translator.translate(texts[:1])
    assert "trois" not in plain[0].text.split() and "trois" in expected[0].text.split()
    status, answer = server.request("/v1/translate", {"text": texts, "constraints": phrases, "api_key": KEY})
    assert status == 200, answer
    got = [t["sentences"][0]["hypotheses"][0]["tokens"] for t in answer["translations"]]
    assert got == [t.hypotheses[0].tokens for t in expected]
    status, answer = server.request("/v1/translate", {"text": texts[0], "constraints": ["trois"], "api_key": KEY})
    assert status == 200 and answer["translations"][0]["text"] == expected[0].text
    # The glossary: its source term in a sentence makes its target term a constraint of that sentence.
    source = f"{GLOSSARY[0]} hundred and two"
    (want,) = translator.translate([source], constraints=[[GLOSSARY[1]]])
    assert GLOSSARY[1] in want.text.split()
    status, answer = server.request("/translate", {"q": source, "source": "en", "target": "fr", "api_key": KEY})
    assert status == 200 and answer["translatedText"] == want.text
    status, health = server.request("/health", method="GET")
    assert status == 200 and health["compilations_after_ready"] == 0, health


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"text": ["one", "two"], "constraints": [["un"], ["a", "b", "c"]]}, 400, "constraints[1]: 3 phrases"),
        ({"text": "one", "constraints": ["un", ""]}, 400, "constraints[0][1] '': empty"),
        (
            {"text": "one", "constraints": ["\u65e5\u672c"]},
            400,
            "constraints[0][0] '\u65e5\u672c': empty, or characters",
        ),
        (
            {"text": "one", "constraints": ["un deux trois quatre cinq"]},
            400,
            "constraints[0][0] 'un deux trois quatre cinq': 5 tokens, more than this service takes (4",
        ),
        ({"text": "one", "constraints": [[1]]}, 400, "constraints[0][0]: expected a phrase"),
        ({"text": "one", "options": {"suppress": "cent"}}, 400, "options.suppress: this service does not take"),
        ({"text": ["one"], "constraints": "un"}, 400, "constraints: expected a list of phrase lists, one per text (1)"),
        ({"text": "one\ntwo", "constraints": ["un"]}, 400, "constraints[0]: constraints need a text of one sentence"),
        ({"q": "one", "source": "en", "target": "de"}, 400, "target 'de' is not a target language of this model"),
        ({"q": "one", "source": "xx", "target": "fr"}, 400, "source 'xx' is not a source language"),
        ({"source": "en", "target": "fr"}, 400, "missing q parameter"),
        ({"q": "one", "source": "en", "target": "fr", "format": "xml"}, 400, "format 'xml'"),
        ({"q": "one", "source": "en", "target": "fr", "alternatives": "x"}, 400, "alternatives: expected a whole"),
        ({"text": "one", "options": {"beam_size": 0}}, 400, "beam_size"),
        ({"text": "one", "options": {"beams": 2}}, 400, "unknown DecodeConfig field(s) ['beams']"),
        ({"text": "one", "options": {"beam_size": [2, 4]}}, 400, "options.beam_size: expected one value"),
        # One rule with the flags': a beam does not apply to sampling (the service's own beam stays, unused).
        ({"text": "one", "options": {"do_sample": True, "beam_size": 3}}, 400, "options.beam_size does not apply"),
        ({"text": "one", "options": {"beam_size": 9}}, 400, "options.beam_size 9: more than this service allows (8)"),
        # The decodings a service runs are compiled at start: its own and what --allow adds.
        ({"text": "one", "options": {"beam_size": 4}}, 400, "options.beam_size 4: this service does not run it"),
        ({"text": "one", "options": {"beam_size": 4}}, 400, "allowed: 2"),
        ({"text": "one", "alignments": True}, 400, "options.alignments True: this service does not run it"),
        ({"text": "one", "options": {"do_sample": True, "top_k": 5}}, 400, "options.do_sample True: this service does"),
        ({"q": "one", "source": "en", "target": "fr", "alternatives": 3}, 400, "alternatives 3: a beam search of 4"),
        ({"text": "one", "options": {"rules": "transformers"}}, 400, "options.rules 'transformers': this service"),
        ({"text": "one", "options": []}, 400, "options: expected an object of decoding settings, got a list"),
        ({"text": "one", "options": ""}, 400, "options: expected an object of decoding settings, got a string"),
        ({"text": "one", "options": 0}, 400, "options: expected an object of decoding settings, got int"),
        ({"text": "one", "options": {"banned": ["x"]}}, 400, "options.banned: expected token ids"),
        ({"text": "one", "options": {"alpha": 100}}, 400, "options.alpha must be at most 10"),
        ({"text": "one", "options": {"n_best": 3}}, 400, "options.n_best 3: more than the 2 hypotheses"),
        ({"q": "one", "source": "en", "target": "fr", "alternatives": True}, 400, "alternatives: expected a whole"),
        ({"q": "one", "source": "en", "target": "fr", "alternatives": "3"}, 400, "alternatives: expected a whole"),
        ({"q": "one \ud800", "source": "en", "target": "fr"}, 400, "q: not Unicode text"),
        ({"q": "x" * 5000, "source": "en", "target": "fr"}, 413, "more than this service takes (4,000)"),
        ({"q": "one", "source": "en", "target": "fr", "api_key": "wrong"}, 403, "Invalid API key"),
    ],
)
def test_bad_requests_are_answered_with_the_documented_errors(server, body, status, message):
    body = {"api_key": KEY, **body}
    path = "/v1/translate" if "text" in body else "/translate"
    got, answer = server.request(path, body)
    assert got == status and message in answer["error"], answer
    # Said in the request's own names, once: no command-line flag, no field named twice.
    assert "--" not in answer["error"] and "options: options" not in answer["error"]
    got, answer = server.request("/translate", b"{not json", headers={"Content-Type": "application/json"})
    assert got == 400 and "not valid JSON" in answer["error"]
    assert server.request("/nowhere", method="GET") == (404, {"error": "Not Found"})


def test_the_key_the_limits_and_a_chunked_body(server):
    import http.client

    body = {"q": "one", "source": "en", "target": "fr"}
    assert server.request("/translate", body)[0] == 403  # no key
    assert server.request("/translate", body, headers={"Authorization": f"Bearer {KEY}"})[0] == 200
    # A body without Content-Length (chunked) is counted as it streams in, and refused past the limit.
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    chunks = (
        json.dumps({"q": "x" * 6000, "source": "en", "target": "fr"})[i : i + 1000].encode()
        for i in range(0, 7000, 1000)
    )
    connection.request("POST", "/translate", chunks, {"Content-Type": "application/json"}, encode_chunked=True)
    response = connection.getresponse()
    assert (
        response.status == 413 and "more than this service takes (4,000 bytes)" in json.loads(response.read())["error"]
    )


def test_concurrent_clients_get_their_own_translations(server, run):
    """A bounded load: 4 clients, 12 requests of one sentence each, all answered, each with its own translation."""
    expected = dict(zip(SENTENCES[:12], translated(run, SENTENCES[:12], beam_size=2)))

    def ask(sentence):
        return sentence, server.request("/translate", {"q": sentence, "source": "en", "target": "fr", "api_key": KEY})

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, SENTENCES[:12]))
    assert [status for _, (status, _) in answers] == [200] * 12
    assert {s: a["translatedText"] for s, (_, a) in answers} == expected


def test_a_full_queue_and_a_sigterm_lose_no_accepted_request(run, tmp_path):
    """Decoding held (tests.helpers.serve_held): one request decoding, 4 sentences waiting fill --max-queue 4, the
    next request is 503; then SIGTERM, then decoding goes on: every accepted request is answered and the process
    exits 0."""
    hold = tmp_path / "hold"
    server = Server(["--checkpoint", str(run), "--step", "latest", "--max-queue", "4", "--max-tokens", "64",
                     "--beam-size", "2"], hold=hold)  # fmt: skip
    expected = dict(zip(SENTENCES[:5], translated(run, SENTENCES[:5], beam_size=2)))
    try:
        hold.touch()
        pool = ThreadPoolExecutor(5)
        first = pool.submit(server.request, "/translate", {"q": SENTENCES[0], "source": "en", "target": "fr"})
        _until(server, lambda h: h["decoding"] == 1 and hold.with_name("hold.inside").exists())
        rest = [
            pool.submit(server.request, "/translate", {"q": s, "source": "en", "target": "fr"}) for s in SENTENCES[1:5]
        ]
        _until(server, lambda h: h["waiting"] == 4)
        status, answer = server.request("/translate", {"q": "one", "source": "en", "target": "fr"})
        assert status == 503 and "the queue is full (4 sentences waiting, at most 4)" in answer["error"]
        five = "\n".join(SENTENCES[:5])  # more sentences than the queue holds at all: never, so not "retry later"
        status, answer = server.request("/translate", {"q": five, "source": "en", "target": "fr"})
        assert status == 413 and "the request holds 5 sentences, more than this service queues (4" in answer["error"]
        server.process.send_signal(signal.SIGTERM)
        hold.unlink()
        answers = [future.result(timeout=120) for future in [first, *rest]]
        assert [a["translatedText"] for _, a in answers] == list(expected.values())
        assert {status for status, _ in answers} == {200}
        assert server.process.wait(timeout=120) == 0, "".join(server.log)
        assert "stopped: " in "".join(server.log)
    finally:
        if hold.exists():
            hold.unlink()
        server.stop()


def _until(server: Server, ready) -> None:
    """Reads /health until `ready(health)` (the held decoding keeps the state still; bounded)."""
    for _ in range(2000):
        status, health = server.request("/health", method="GET")
        if status == 200 and ready(health):
            return
        time.sleep(0.01)
    raise AssertionError(f"the service never reached the state: {health}")


def test_a_multilingual_model_translates_into_the_target_asked_for(tmp_path):
    """A tiny random NLLB model: LibreTranslate's ISO codes and NLLB's own give what translate gives with
    --src-lang / --tgt-lang, the target's code forced first."""
    pytest.importorskip("transformers")
    from jax_transformer.interop import hub
    from tests.helpers.multilingual import TOKENIZERS, model_vocab_size, tiny_model

    folder = tmp_path / "nllb"
    tiny_model("nllb", model_vocab_size("nllb", TOKENIZERS["nllb"](folder))).save_pretrained(folder)
    run = hub.import_model(folder, tmp_path / "run", print_fn=lambda line: None)
    server = Server(["--checkpoint", str(run), "--step", "latest", "--max-tokens", "64"])
    try:
        source = tmp_path / "source.txt"
        source.write_text("".join(s + "\n" for s in SENTENCES[:4]), encoding="utf-8")
        for src, tgt, iso in (("eng_Latn", "fra_Latn", ("en", "fr")), ("fra_Latn", "eng_Latn", ("fr", "en"))):
            args = ["translate", "--checkpoint", str(run), "--step", "latest", "--input", str(source)]
            code, out, err = run_main([*args, "--src-lang", src, "--tgt-lang", tgt])
            assert code == 0, err
            for source_code, target_code in (iso, (src, tgt)):
                body = {"q": SENTENCES[:4], "source": source_code, "target": target_code}
                status, answer = server.request("/translate", body)
                assert status == 200 and answer["translatedText"] == out.splitlines(), answer
        status, listing = server.request("/languages", method="GET")
        assert status == 200 and {"en", "fr", "de"} <= {entry["code"] for entry in listing}
        # Detection among the model's source languages (py3langid's model), and a source it detects.
        german = "Der Hund läuft schnell über die Straße, weil er die Katze sieht."
        status, found = server.request("/detect", {"q": german})
        assert status == 200 and found[0]["language"] == "de" and found[0]["confidence"] > 50
        status, answer = server.request("/translate", {"q": german, "source": "auto", "target": "en"})
        assert status == 200 and answer["detectedLanguage"]["language"] == "de"
        # The native endpoint asks a multilingual model for both languages.
        status, answer = server.request("/v1/translate", {"text": "one"})
        assert status == 400 and "missing source parameter" in answer["error"]
    finally:
        assert server.stop() == 0, "".join(server.log)
