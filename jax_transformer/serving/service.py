"""`train.py serve`: one process keeps a model and its compiled decoders and answers translations over HTTP.

- `Batcher`: a thread that owns the model. Requests that arrive within `batch_window_ms` of each other share a
  batch, up to `max_tokens` source tokens; each group of equal decoding options and languages decodes together
  (`translation.translations`, sorted by length as `translate` sorts). A full queue is refused, not grown.
- `Languages`: the model's codes (NLLB's eng_Latn, mBART-50's en_XX, M2M-100's en) and the ISO 639-1 codes
  LibreTranslate's clients send ("en"), mapped by `langcodes`; `Detector` guesses a text's language with
  py3langid, whose model ships inside its package.
- `app`: a Starlette application with LibreTranslate's `POST /translate`, `GET /languages` and `POST /detect`
  (so its clients work unchanged), a native `POST /v1/translate` with every decoding option and the scores, and
  `GET /health`. Every error is a JSON body {"error": ...} with its status: 400 for a bad field (named), 403 for a
  wrong API key, 413 for a body over the limit, 503 when the queue is full.
- `serve`: uvicorn on 127.0.0.1 unless told otherwise. SIGTERM stops accepting connections, lets the requests in
  flight finish (uvicorn's graceful shutdown, then the batcher drains), and exits.

Why Starlette and uvicorn (the `serve` extra): a small, maintained ASGI stack (FastAPI is built on it) with
graceful shutdown and request streaming, so the body limit holds before a body is read. A text is split into
sentences with the layout kept (`documents.Segmenter`) as LibreTranslate splits its input.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import hmac
import json
import logging
import signal
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

from jax_transformer.errors import ConfigError, DataError, TokenError
from jax_transformer.settings.config import DecodeConfig, ServeConfig

log = logging.getLogger(__name__)

EXTRA = "pip install -e '.[serve]'"


class HTTPError(Exception):
    """An answer other than 200: its status and the message of its JSON body."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


# =============================================================================================================
# Languages
# =============================================================================================================


def iso_code(code: str) -> str | None:
    """The ISO 639-1 code (or 639-3 where there is none) of a model's language code: eng_Latn -> en, en_XX -> en,
    de -> de; None where langcodes reads none."""
    import langcodes

    try:
        return langcodes.Language.get(code.replace("_", "-").split("-")[0]).language
    except (ValueError, LookupError):
        return None


class Languages:
    """The languages a model translates between: its own codes (a multilingual tokenizer's, or the one pair of a
    model without codes), each also reachable by its ISO 639-1 code (the first model code of a language wins, e.g.
    zho_Hans for "zh"; the model's own codes are always accepted)."""

    def __init__(self, sources: Sequence[str], targets: Sequence[str], multilingual: bool) -> None:
        self.sources, self.targets, self.multilingual = list(sources), list(targets), multilingual
        self.alias: dict[str, str] = {}
        for code in dict.fromkeys([*sources, *targets]):
            short = iso_code(code)
            if short and short not in self.alias:
                self.alias[short] = code

    @classmethod
    def of(cls, loaded, pair: str | None) -> Languages:
        tokenizer = loaded.tokenizer
        if hasattr(tokenizer, "codes"):
            codes = list(tokenizer.codes)
            return cls(codes, codes, True)
        src, tgt = _pair(loaded, pair)
        return cls([src], [tgt], False)

    def code(self, given: Any, field: str, side: str) -> str:
        """The model's code for `given` (its own, or an ISO code), else HTTPError 400 naming the field."""
        known = self.sources if side == "source" else self.targets
        if not isinstance(given, str) or not given:
            raise HTTPError(400, f"Invalid request: missing {field} parameter")
        code = given if given in known else self.alias.get(given.lower())
        if code not in known:
            import difflib

            candidates = [*(iso for iso, code in self.alias.items() if code in known), *known]
            close = difflib.get_close_matches(given, candidates, n=5, cutoff=0.4)
            hint = f" (closest: {', '.join(close)})" if close else f" (this model: {', '.join(self.short(known))})"
            raise HTTPError(400, f"{field} {given!r} is not a {side} language of this model{hint}")
        return code

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
        src, _, tgt = given.partition("-")
        if not src or not tgt:
            raise ConfigError(f"--languages {given!r}: expected SRC-TGT, e.g. de-en")
        return src, tgt
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


class Detector:
    """A text's language among the model's source languages: py3langid (its model ships inside the package) with
    normalized probabilities; [(model code, confidence 0-100)], most likely first."""

    def __init__(self, languages: Languages) -> None:
        try:
            from py3langid.langid import MODEL_FILE, LanguageIdentifier
        except ImportError:
            raise ConfigError(f"language detection needs py3langid: {EXTRA}") from None
        self.identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        self.codes = {iso: code for iso, code in languages.alias.items() if code in languages.sources}
        known = [iso for iso in self.codes if iso in self.identifier.nb_classes]
        if not known:
            raise ConfigError("language detection: none of this model's source languages is one py3langid knows")
        self.identifier.set_languages(known)

    def detect(self, text: str, n: int = 3) -> list[tuple[str, float]]:
        ranked = self.identifier.rank(text)[:n]
        return [(self.codes[iso], round(100.0 * float(p), 2)) for iso, p in ranked]


# =============================================================================================================
# Batching requests
# =============================================================================================================


class QueueFull(Exception):
    pass


class TooMany(Exception):
    """A request of more sentences than the whole queue holds: it could never be taken (413, not 503)."""


@dataclasses.dataclass
class Job:
    """Sentences of one request, decoded alike: their translations go to `future`."""

    sentences: list[str]
    decode: DecodeConfig
    languages: tuple[str | None, str | None]
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    tokens: int | None = None  # source tokens, EOS included: counted when the batcher first looks at the job

    @property
    def key(self):
        return self.decode, self.languages


class Batcher:
    """The thread that owns the model. `submit` queues a request's sentences (QueueFull past `max_queue`); the
    thread takes the first waiting request, waits `window_s` for others (or until `max_tokens` source tokens
    wait), and decodes each group of equal options and languages in one `translations` call."""

    def __init__(self, loaded, *, max_tokens: int, window_s: float, max_queue: int) -> None:
        self.loaded, self.max_tokens, self.window_s, self.max_queue = loaded, max_tokens, window_s, max_queue
        self.jobs: collections.deque[Job] = collections.deque()
        self.waiting = 0  # sentences queued, not yet taken
        self.busy = 0  # sentences being decoded
        self.served = self.batches = 0
        self.closing = False
        self.lock = threading.Condition()
        self.tokenizers: dict[tuple, Any] = {}
        self.thread = threading.Thread(target=self._run, name="decoder", daemon=True)

    def start(self) -> Batcher:
        self.thread.start()
        return self

    def submit(
        self, sentences: list[str], decode: DecodeConfig, languages=(None, None), tokens: int | None = None
    ) -> concurrent.futures.Future:
        """Queues a request's sentences (`tokens`: their source tokens, counted by the caller off the lock)."""
        job = Job(list(sentences), decode, tuple(languages), tokens=tokens)
        if len(job.sentences) > self.max_queue:
            raise TooMany(
                f"the request holds {len(job.sentences)} sentences, more than this service queues ({self.max_queue}, "
                f"--max-queue): send them in several requests"
            )
        with self.lock:
            if self.closing or not self.thread.is_alive() and self.thread.ident is not None:
                raise QueueFull("the service is shutting down")
            if self.waiting + len(job.sentences) > self.max_queue:
                raise QueueFull(
                    f"the queue is full ({self.waiting} sentences waiting, at most {self.max_queue}); retry later"
                )
            self.jobs.append(job)
            self.waiting += len(job.sentences)
            self.lock.notify()
        return job.future

    def close(self, timeout: float | None = None) -> None:
        """Refuses new requests, decodes the queued ones, then ends the thread."""
        with self.lock:
            self.closing = True
            self.lock.notify()
        self.thread.join(timeout)

    def tokenizer(self, languages: tuple[str | None, str | None]):
        """The tokenizer for a language pair (a view of the model's: the same files, its languages set)."""
        if languages not in self.tokenizers:
            from jax_transformer.data.tokenizer import with_languages

            self.tokenizers[languages] = with_languages(self.loaded.tokenizer, *languages)
        return self.tokenizers[languages]

    def tokens(self, sentences: Sequence[str], languages) -> int:
        """Source tokens of `sentences`, EOS included."""
        return sum(len(ids) + 1 for ids in self.tokenizer(tuple(languages)).encode_batch(list(sentences)))

    def _take(self) -> list[Job] | None:
        """The next batch: the first waiting job and those that join it within the window, up to the budget."""
        with self.lock:
            while not self.jobs:
                if self.closing:
                    return None
                self.lock.wait()
            taken = [self.jobs.popleft()]
            tokens = self._tokens(taken[0])
            deadline = time.monotonic() + self.window_s
            while tokens < self.max_tokens and not self.closing:
                if not self.jobs:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.lock.wait(left)
                    continue
                tokens += self._tokens(self.jobs[0])
                taken.append(self.jobs.popleft())
            moved = sum(len(job.sentences) for job in taken)
            self.waiting -= moved
            self.busy += moved
            return taken

    def _tokens(self, job: Job) -> int:
        if job.tokens is None:  # (callers count them before they submit, off the lock)
            job.tokens = self.tokens(job.sentences, job.languages)
        return job.tokens

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # the thread must not end quietly with requests waiting: fail them, refuse more
            with self.lock:
                self.closing = True
                waiting, self.jobs = list(self.jobs), collections.deque()
            for job in waiting:
                if job.future.set_running_or_notify_cancel():
                    job.future.set_exception(RuntimeError(f"the decoder stopped: {type(e).__name__}: {e}"))
            raise

    def _serve(self) -> None:
        from jax_transformer.decoding.translation import translations

        while (taken := self._take()) is not None:
            groups: dict[Any, list[Job]] = {}
            for job in taken:
                if job.future.set_running_or_notify_cancel():  # False: its client is gone (a cancelled request)
                    groups.setdefault(job.key, []).append(job)
            for (decode, languages), jobs in groups.items():
                sentences = [s for job in jobs for s in job.sentences]
                try:
                    found = translations(
                        self.loaded.params,
                        self.loaded.config,
                        self.tokenizer(languages),
                        sentences,
                        decode,
                        max_tokens=self.max_tokens,  # batches by the same budget (rows x padded width)
                        progress=False,
                    )
                except Exception as e:  # noqa: BLE001 (the request gets the error; the service goes on)
                    for job in jobs:
                        job.future.set_exception(e)
                else:
                    start = 0
                    for job in jobs:
                        job.future.set_result(found[start : start + len(job.sentences)])
                        start += len(job.sentences)
                self.batches += 1
            with self.lock:
                done = sum(len(job.sentences) for job in taken)
                self.busy -= done
                self.served += done


# =============================================================================================================
# The HTTP application
# =============================================================================================================


@dataclasses.dataclass
class Service:
    """What the handlers share: the model, its decoding defaults, languages, the batcher and the limits."""

    loaded: Any
    decode: DecodeConfig
    languages: Languages
    batcher: Batcher
    settings: ServeConfig
    segmenter: Callable[[str], Any]  # language code -> documents.Segmenter
    detector: Detector | None = None
    api_key: str | None = None

    def decoding(self, options: Any, field: str = "options") -> DecodeConfig:
        """The request's decoding: the fields given (DecodeConfig's names) over the service's, by the rules the
        flags follow (`settings.resolve.request_decoding`), checked against --max-beam (each new width compiles
        programs on the decoder thread)."""
        from jax_transformer.settings.resolve import request_decoding

        if not options:
            return self.decode
        if not isinstance(options, dict):
            raise HTTPError(400, f"{field}: expected an object of decoding settings, got {type(options).__name__}")
        for name, value in options.items():
            if isinstance(value, (list, dict)):
                raise HTTPError(400, f"{field}.{name}: expected one value, got {type(value).__name__}")
        try:
            decode = request_decoding(self.loaded.config, self.decode, options, field)
        except (ConfigError, TypeError, ValueError) as e:
            raise HTTPError(400, f"{field}: {e}") from None
        most = self.settings.max_beam
        for name, value in (("beam_size", decode.beams), ("n_best", decode.n_best)):  # sampling keeps one beam
            if value > most:
                raise HTTPError(400, f"{field}.{name} {value}: more than this service allows ({most})")
        return decode

    def pair(self, source: Any, target: Any) -> tuple[str | None, str | None]:
        src = self.languages.code(source, "source", "source")
        tgt = self.languages.code(target, "target", "target")
        return (src, tgt) if self.languages.multilingual else (None, None)

    async def translate(self, texts: list[str], decode: DecodeConfig, pair) -> list[list[Any]]:
        """Each text's sentences (their pieces, layout kept) with their `Translation`s: [(pieces, translations)]."""

        def prepare():  # splitting and tokenizing: in a worker thread, off the event loop and the batcher's lock
            segmenter = self.segmenter(pair[0] or self.languages.sources[0])
            pieces = [segmenter.split(text) for text in texts]
            sentences = [piece.text for each in pieces for piece in each if piece.sentence]
            return pieces, sentences, self.batcher.tokens(sentences, pair)

        pieces, sentences, tokens = await asyncio.to_thread(prepare)
        try:
            future = self.batcher.submit(sentences, decode, pair, tokens) if sentences else None
        except TooMany as e:
            raise HTTPError(413, str(e)) from None
        except QueueFull as e:
            raise HTTPError(503, str(e), {"Retry-After": "1"}) from None
        found = await asyncio.wrap_future(future) if future is not None else []
        out, start = [], 0
        for each in pieces:
            n = sum(piece.sentence for piece in each)
            out.append((each, found[start : start + n]))
            start += n
        return out


def joined(pieces, translations, rank: int = 0) -> str:
    """The text with each sentence replaced by its `rank`-th translation ("" where it has fewer), joined as
    `translate --document` joins a document (`documents.joined`)."""
    from jax_transformer.decoding import documents

    return documents.joined(pieces, (t.hypotheses[rank].text if rank < len(t.hypotheses) else "" for t in translations))


async def read_body(request, limit: int) -> dict[str, Any]:
    """The request's fields (JSON, or a form as libretranslatepy and HTML forms send), refused with 413 past
    `limit` bytes before more is read."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise HTTPError(413, f"the request body is {int(length):,} bytes, more than this service takes ({limit:,})")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HTTPError(413, f"the request body is more than this service takes ({limit:,} bytes)")
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    fields: dict[str, Any] = {}
    if body and kind == "application/json":
        try:
            fields = json.loads(body)
        except ValueError as e:
            raise HTTPError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(fields, dict):
            raise HTTPError(400, "the body must be a JSON object")
    elif body:
        if kind not in ("", "application/x-www-form-urlencoded"):
            raise HTTPError(415, f"content type {kind!r}: send application/json or application/x-www-form-urlencoded")
        try:
            fields = {k: v[-1] for k, v in urllib.parse.parse_qs(body.decode("utf-8"), keep_blank_values=True).items()}
        except UnicodeDecodeError:
            raise HTTPError(400, "the form is not UTF-8") from None
    for key, values in urllib.parse.parse_qs(request.url.query).items():
        fields.setdefault(key, values[-1])
    return fields


def _unique(texts: list[str], translation: str) -> list[str]:
    out: list[str] = []
    for text in texts:
        if text and text != translation and text not in out:
            out.append(text)
    return out


def _int_field(fields: dict[str, Any], name: str, default: int) -> int:
    value = fields.get(name, default)
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        raise HTTPError(400, f"{name}: expected a whole number, got {value!r}") from None
    if number < 0:
        raise HTTPError(400, f"{name}: expected 0 or more, got {number}")
    return number


def _texts(fields: dict[str, Any], name: str) -> tuple[list[str], bool]:
    """(texts, whether one string was sent) of field `name`: a string or a list of strings."""
    value = fields.get(name)
    if value is None:
        raise HTTPError(400, f"Invalid request: missing {name} parameter")
    texts, one = ([value], True) if isinstance(value, str) else (value, False)
    if not isinstance(texts, list) or not all(isinstance(v, str) for v in texts):
        raise HTTPError(400, f"{name}: expected a string or a list of strings")
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON can carry a lone surrogate ("\ud800"), which is no text
            where = name if one else f"{name}[{i}]"
            raise HTTPError(400, f"{where}: not Unicode text: {e.reason} at character {e.start}") from None
    return texts, one


def app(service: Service):
    """The Starlette application of `service`."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    def checked(handler, keyed: bool = True):
        async def endpoint(request):
            try:
                fields = await read_body(request, service.settings.max_request_bytes)
                if keyed and service.api_key is not None:
                    bearer = request.headers.get("authorization", "")
                    given = str(fields.get("api_key", bearer[7:] if bearer[:7].lower() == "bearer " else ""))
                    key = given.encode("utf-8", "surrogatepass")
                    if not hmac.compare_digest(key, service.api_key.encode()):
                        raise HTTPError(403, "Invalid API key")
                return JSONResponse(await handler(fields))
            except HTTPError as e:
                return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)
            except (DataError, ConfigError, TokenError) as e:  # a sentence or option the model refuses
                return JSONResponse({"error": str(e)}, status_code=400)
            except Exception as e:  # noqa: BLE001 (answered as JSON, logged; the service goes on)
                log.exception("%s %s failed", request.method, request.url.path)
                return JSONResponse({"error": f"internal error: {type(e).__name__}: {e}"}, status_code=500)

        return endpoint

    async def translate(fields):
        texts, one = _texts(fields, "q")
        if (fields.get("format") or "text") != "text":  # (LibreTranslate reads "" and null as text too)
            raise HTTPError(400, f"format {fields.get('format')!r}: this service translates plain text ('text')")
        alternatives = _int_field(fields, "alternatives", 0)
        detected = None
        source = fields.get("source")
        if source == "auto":
            if service.detector is None:
                raise HTTPError(400, f"source 'auto': language detection is off (install py3langid: {EXTRA})")
            code, confidence = (await asyncio.to_thread(service.detector.detect, " ".join(texts), 1))[0]
            detected, source = {"confidence": confidence, "language": service.languages.short([code])[0]}, code
        decode = service.decode
        if alternatives:
            n = alternatives + 1
            decode = service.decoding({"n_best": n, "beam_size": max(n, decode.beam_size)}, "alternatives")
        results = await service.translate(texts, decode, service.pair(source, fields.get("target")))
        translated = [joined(pieces, found) for pieces, found in results]
        answer: dict[str, Any] = {"translatedText": translated[0] if one else translated}
        if alternatives:  # as LibreTranslate: the other texts, none empty, none twice, none the translation itself
            others = [
                _unique([joined(pieces, found, rank) for rank in range(1, alternatives + 1)], text)
                for (pieces, found), text in zip(results, translated)
            ]
            answer["alternatives"] = others[0] if one else others
        if detected is not None:
            answer["detectedLanguage"] = detected if one else [detected] * len(texts)
        return answer

    async def native(fields):
        texts, _ = _texts(fields, "text")
        decode = service.decoding(fields.get("options"))
        if service.languages.multilingual:  # source and target: required (a model of one pair has its own)
            pair = service.pair(fields.get("source"), fields.get("target"))
        else:
            pair = service.pair(fields.get("source", service.languages.sources[0]),
                                fields.get("target", service.languages.targets[0]))  # fmt: skip
        began = time.monotonic()
        results = await service.translate(texts, decode, pair)
        return {
            "translations": [
                {
                    "text": joined(pieces, found),
                    "sentences": [
                        {"source": t.source, "hypotheses": [dataclasses.asdict(h) for h in t.hypotheses]} for t in found
                    ],
                }
                for pieces, found in results
            ],
            "decoding": decode.describe(),
            "seconds": round(time.monotonic() - began, 4),
        }

    async def languages(fields):
        return service.languages.listing()

    async def detect(fields):
        texts, _ = _texts(fields, "q")
        if service.detector is None:
            raise HTTPError(400, f"language detection is off (install py3langid: {EXTRA})")
        ranked = await asyncio.to_thread(service.detector.detect, " ".join(texts))
        return [{"confidence": c, "language": service.languages.short([code])[0]} for code, c in ranked]

    async def health(fields):
        b = service.batcher
        return {
            "status": "ok" if b.thread.is_alive() and not b.closing else "stopped",
            "model": str(service.loaded.directory),
            "step": service.loaded.step,
            "waiting": b.waiting,
            "decoding": b.busy,
            "served": b.served,
            "batches": b.batches,
        }

    routes = [
        Route("/translate", checked(translate), methods=["POST"]),
        Route("/languages", checked(languages, keyed=False), methods=["GET", "POST"]),  # as LibreTranslate's
        Route("/detect", checked(detect), methods=["POST"]),
        Route("/v1/translate", checked(native), methods=["POST"]),
        Route("/health", checked(health, keyed=False), methods=["GET"]),
    ]

    async def not_here(request, error):  # 404, 405 and the like: JSON as every other answer
        return JSONResponse({"error": error.detail}, status_code=error.status_code, headers=error.headers)

    return Starlette(routes=routes, exception_handlers={HTTPException: not_here})


# =============================================================================================================
# Running it
# =============================================================================================================


def read_api_key(settings: ServeConfig) -> str | None:
    """The key of --api-key-file (None without one); a file that is missing, unreadable or empty is a ConfigError,
    said before the model loads."""
    if not settings.api_key_file:
        return None
    try:
        with open(settings.api_key_file, encoding="utf-8") as f:
            api_key = f.read().strip()
    except OSError as e:
        raise ConfigError(f"--api-key-file {settings.api_key_file}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--api-key-file {settings.api_key_file}: not UTF-8 text") from None
    if not api_key:
        raise ConfigError(f"--api-key-file {settings.api_key_file}: the file is empty")
    return api_key


def build(translator, settings: ServeConfig, *, detect: bool = True, api_key: str | None = None) -> Service:
    """The service of a model loaded to translate (`decoding.translator.Translator`: its weights and its decoding):
    its languages, detector (where py3langid is installed), key and batcher (not started). `api_key`: read already
    (`read_api_key`: a pipe is read once); else --api-key-file's, read here."""
    from jax_transformer.data.tokenizer import with_languages
    from jax_transformer.decoding.documents import Segmenter, model_fits

    loaded, decode = translator.loaded, translator.decode

    languages = Languages.of(loaded, settings.languages)
    segmenters: dict[str, Any] = {}

    def segmenter(code: str):  # a source language's splitter; a sentence must fit with its code (if any)
        if code not in segmenters:
            tokenizer = with_languages(loaded.tokenizer, code if languages.multilingual else None)
            segmenters[code] = Segmenter(code, model_fits(tokenizer, loaded.config))
        return segmenters[code]

    detector = None
    if detect:
        try:
            detector = Detector(languages)
        except ConfigError:
            detector = None
    api_key = api_key if api_key is not None else read_api_key(settings)
    window = settings.batch_window_ms / 1000
    batcher = Batcher(loaded, max_tokens=settings.max_tokens, window_s=window, max_queue=settings.max_queue)
    return Service(loaded, decode, languages, batcher, settings, segmenter, detector, api_key)


def serve(service: Service, print_fn: Callable[[str], None] = print) -> None:
    """Warms the decoders up, listens, and serves until SIGTERM or SIGINT (then drains, as the module says)."""
    import socket

    try:
        import uvicorn
    except ImportError:
        raise ConfigError(f"serve needs uvicorn and starlette: {EXTRA}") from None
    settings = service.settings
    began = time.monotonic()
    service.batcher.start()
    warm = service.batcher.submit(["hello"], service.decode, service.pair(*_first_pair(service.languages)))
    warm.result()  # the first decoding compiles its programs: before the first client waits for it
    print_fn(f"decoders ready in {time.monotonic() - began:.1f} s")
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as e:
        raise ConfigError(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}") from None
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app(service),
        log_level="warning",
        timeout_graceful_shutdown=settings.shutdown_timeout_s,
        limit_concurrency=settings.max_connections,
    )
    listening = f"serving http://{host}:{port} (LibreTranslate's /translate, /languages, /detect; /v1/translate; "
    listening += "/health)"
    server = _server_class(uvicorn, lambda: print_fn(listening))(config)
    try:
        server.run(sockets=[sock])
    finally:
        service.batcher.close(settings.shutdown_timeout_s)
        print_fn(f"stopped: {service.batcher.served} sentences served in {service.batcher.batches} batches")


def _server_class(uvicorn, on_listening: Callable[[], None]):
    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if not self.should_exit:  # listening now: a client may connect once this is printed
                on_listening()

        @contextlib.contextmanager
        def capture_signals(self):
            # As uvicorn's, without raising the signal again once the requests in flight are answered: the batcher
            # still drains, and a graceful stop exits 0 (uvicorn would end the process by the signal itself).
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server


def _first_pair(languages: Languages) -> tuple[str, str]:
    source = languages.sources[0]
    return source, next((t for t in languages.targets if t != source), languages.targets[0])
