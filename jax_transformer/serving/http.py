"""The HTTP application: LibreTranslate's `POST /translate`, `GET /languages` and `POST /detect` (so its clients work
unchanged), a native `POST /v1/translate` with every decoding option and the scores, `GET /health` and `GET
/metrics`. Every answer but a translation is a JSON body {"error": ...} with its status (docs/serving.md lists
them). A request's body is read under a size limit and a deadline, and dropped if the service starts shutting down
before it has arrived; its fields are checked strictly (a JSON number where a number is meant, text that is
UTF-8), and each is named in its error."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import itertools
import json
import logging
import time
import urllib.parse
from typing import Any

from jax_transformer.errors import ConfigError, DataError, TokenError
from jax_transformer.serving import markup
from jax_transformer.serving.errors import HTTPError
from jax_transformer.serving.metrics import now_ms
from jax_transformer.serving.steering import request_phrases

log = logging.getLogger("jax_transformer.serving")


class Fields(dict):
    """A request's fields; `texts` names those that came as text (a form or the query string), where a number is
    written as digits, not a JSON number."""

    texts: frozenset[str] = frozenset()


class Gone(Exception):
    """The client left before its request had arrived: nothing to answer."""


async def _receive(request, limit: int, timeout_s: float, stopping: asyncio.Event, readers: set) -> bytearray:
    """The request's body, refused with 413 past `limit` bytes before more is read, 408 if it has not arrived
    within `timeout_s`, 503 if the service starts shutting down first (its shutdown cancels the tasks in `readers`:
    a request whose body has not arrived is dropped)."""
    from starlette.requests import ClientDisconnect

    if stopping.is_set():
        raise HTTPError(503, SHUTTING_DOWN, {"Connection": "close"})
    body = bytearray()

    async def read_all() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise HTTPError(413, f"the request body is more than this service takes ({limit:,} bytes)")

    task = asyncio.current_task()
    readers.add(task)
    try:
        if hasattr(asyncio, "timeout"):  # (3.11: no task of its own)
            async with asyncio.timeout(timeout_s):
                await read_all()
        else:
            await asyncio.wait_for(read_all(), timeout_s)
    except asyncio.TimeoutError:
        raise HTTPError(
            408, f"the request body did not arrive within {timeout_s:g} s", {"Connection": "close"}
        ) from None
    except asyncio.CancelledError:
        if not stopping.is_set():
            raise
        if hasattr(task, "uncancel"):
            task.uncancel()
        raise HTTPError(503, SHUTTING_DOWN, {"Connection": "close"}) from None
    except ClientDisconnect:
        raise Gone() from None
    finally:
        readers.discard(task)
    return body


SHUTTING_DOWN = "the service is shutting down: this request's body had not arrived"


async def read_body(request, limit: int, timeout_s: float, stopping: asyncio.Event, readers: set) -> Fields:
    """The request's fields (JSON, or a form as libretranslatepy and HTML forms send, and the query string), the
    body read by `_receive`'s rules."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise HTTPError(413, f"the request body is {int(length):,} bytes, more than this service takes ({limit:,})")
    body = await _receive(request, limit, timeout_s, stopping, readers)
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    fields = Fields()
    texts = set()
    if body and kind == "application/json":
        try:
            found = json.loads(body)
        except RecursionError:
            raise HTTPError(400, "the body is not valid JSON: nested too deeply") from None
        except ValueError as e:
            raise HTTPError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(found, dict):
            raise HTTPError(400, "the body must be a JSON object")
        fields.update(found)
    elif body:
        if kind not in ("", "application/x-www-form-urlencoded"):
            raise HTTPError(415, f"content type {kind!r}: send application/json or application/x-www-form-urlencoded")
        form = _form(bytes(body), "the form")
        fields.update(form)
        texts |= set(form)
    query = _form(request.url.query.encode("latin-1", "replace"), "the query string")
    for key, value in query.items():
        if key not in fields:
            fields[key] = value
            texts.add(key)
    fields.texts = frozenset(texts)
    return fields


def _form(data: bytes, what: str) -> dict[str, str]:
    """URL-encoded `name=value&...` (the last of a repeated name wins), each %-escaped name and value UTF-8 or a
    400 naming it: a replacement character would be translated as if it were text."""
    out = {}
    try:
        pairs = urllib.parse.parse_qsl(data.decode("ascii"), keep_blank_values=True, errors="surrogateescape")
    except UnicodeDecodeError:
        raise HTTPError(400, f"{what} is not URL-encoded: it holds bytes that are not ASCII") from None
    for name, value in pairs:
        for part, text in (("name", name), (f"field {name!r}", value)):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                shown = name.encode("utf-8", "replace").decode()
                where = "a field name" if part == "name" else f"field {shown!r}"
                raise HTTPError(400, f"{what}: {where} is not UTF-8 (byte {e.start} of it, once decoded)") from None
        out[name] = value
    return out


def int_field(fields: Fields, name: str, default: int) -> int:
    """A whole number >= 0: a JSON integer, or digits where the field came as text (a form)."""
    value = fields.get(name, default)
    if value is None:
        return default
    if name in fields.texts and isinstance(value, str):
        if not value.strip().isdigit():
            raise HTTPError(400, f"{name}: expected a whole number, got {value!r}")
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise HTTPError(400, f"{name}: expected a whole number, got {json.dumps(value)[:40]}")
    if value < 0:
        raise HTTPError(400, f"{name}: expected 0 or more, got {value}")
    return value


def texts_field(fields: Fields, name: str) -> tuple[list[str], bool]:
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


def _unique(texts: list[str], translation: str) -> list[str]:
    out: list[str] = []
    for text in texts:
        if text and text != translation and text not in out:
            out.append(text)
    return out


_ids = itertools.count(1)


def app(service):
    """The Starlette application of `service` (`service.Service`)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    settings = service.settings

    def client_of(request, fields: Fields) -> str:
        key = fields.get("api_key") if isinstance(fields.get("api_key"), str) else None
        bearer = request.headers.get("authorization", "")
        key = key or (bearer[7:] if bearer[:7].lower() == "bearer " else None)
        return f"key:{key}" if key else f"address:{request.client.host if request.client else ''}"

    def checked(handler, route: str, keyed: bool = True, limited: bool = True):
        async def endpoint(request):
            began, record = time.monotonic(), {"id": next(_ids), "route": route, "sentences": 0}
            record["client"] = request.client.host if request.client else None
            status, response = 500, None
            try:
                fields = await read_body(
                    request, settings.max_request_bytes, settings.body_timeout_s, service.stopping, service.readers
                )
                if keyed and service.api_key is not None:
                    bearer = request.headers.get("authorization", "")
                    given = str(fields.get("api_key", bearer[7:] if bearer[:7].lower() == "bearer " else ""))
                    key = given.encode("utf-8", "surrogatepass")
                    if not hmac.compare_digest(key, service.api_key.encode()):
                        raise HTTPError(403, "Invalid API key")
                if limited:
                    service.limits.check(client_of(request, fields), _characters(fields))
                answer = await handler(fields, record)
                status, response = 200, answer if isinstance(answer, Response) else JSONResponse(answer)
            except Gone:
                status = 499  # (nginx's "client closed request"; nothing is sent)
                log.info("request %d: the client left before its body arrived", record["id"])
            except HTTPError as e:
                status, response = e.status, JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)
                if e.status in (408, 429, 503):
                    service.metrics.refused.labels(str(e.status)).inc()
            except (DataError, ConfigError, TokenError) as e:  # a sentence or option the model refuses
                status, response = 400, JSONResponse({"error": str(e)}, status_code=400)
            except Exception as e:  # noqa: BLE001 (answered as JSON, logged; the service goes on)
                log.exception("%s %s failed", request.method, request.url.path)
                response = JSONResponse({"error": f"internal error: {type(e).__name__}: {e}"}, status_code=500)
            record.update(status=status, ms=now_ms(began))
            service.metrics.requests.labels(route, str(status)).inc()
            service.metrics.latency.labels(route).observe(time.monotonic() - began)
            if route != "/metrics":
                service.access.line(record)
            if response is None:
                return Response(status_code=400)
            if service.stopping.is_set():  # a keep-alive client must not send its next request here
                response.headers["connection"] = "close"
            return response

        return endpoint

    async def translate(fields, record):
        texts, one = texts_field(fields, "q")
        kind = markup.format_field(fields, ("text", "html"))  # (LibreTranslate reads "" and null as text too)
        alternatives = int_field(fields, "alternatives", 0)
        if alternatives and kind != "text":
            raise HTTPError(400, f"alternatives {alternatives}: not taken with format {kind!r} (one translation)")
        detected = None
        source = fields.get("source")
        if source == "auto":
            code, confidence = await service.detect(texts if kind == "text" else list(map(markup.visible_text, texts)))
            detected, source = {"confidence": confidence, "language": code}, code
        model, pair = service.route(source, fields.get("target"))
        decode = model.decode
        if kind != "text":
            done = await markup.translate(model, texts, markup.aligned_decoding(model, decode), pair,
                                          rules=markup.rules_for(kind), field="q", one=one,
                                          target_language=markup.target_code(model, fields.get("target")))  # fmt: skip
            translated = [text for text, _, _ in done]
            record.update(model=model.name, sentences=sum(len(found) for _, _, found in done), text=texts,
                          translation=translated)  # fmt: skip
            answer = {"translatedText": translated[0] if one else translated}
            if detected is not None:
                answer["detectedLanguage"] = detected if one else [detected] * len(texts)
            return answer
        if alternatives:
            n = alternatives + 1
            try:
                decode = model.decoding({"n_best": n, "beam_size": max(n, decode.beam_size)}, "alternatives")
            except HTTPError as e:  # a beam not compiled: said as what the client asked for
                if "does not run it" not in e.message:
                    raise
                raise HTTPError(400, f"alternatives {alternatives}: a beam search of {max(n, decode.beam_size)} "
                                     f"is not among the decodings this service runs ({model.allowed.describe()})",
                                ) from None  # fmt: skip
        results = await model.translate(texts, decode, pair)
        translated = [model.joined(pieces, found) for pieces, found in results]
        record.update(model=model.name, sentences=sum(len(found) for _, found in results), text=texts,
                      translation=translated)  # fmt: skip
        answer: dict[str, Any] = {"translatedText": translated[0] if one else translated}
        if alternatives:  # as LibreTranslate: the other texts, none empty, none twice, none the translation itself
            others = [
                _unique([model.joined(pieces, found, rank) for rank in range(1, alternatives + 1)], text)
                for (pieces, found), text in zip(results, translated)
            ]
            answer["alternatives"] = others[0] if one else others
        if detected is not None:
            answer["detectedLanguage"] = detected if one else [detected] * len(texts)
        return answer

    async def native(fields, record):
        texts, one = texts_field(fields, "text")
        kind = markup.format_field(fields)
        model, pair = service.route(fields.get("source"), fields.get("target"), fields.get("model"), native=True)
        options = fields.get("options")
        if fields.get("alignments") is not None and (options is None or isinstance(options, dict)):
            options = {**(options or {}), "alignments": fields.get("alignments")}  # one of the options, given beside
        decode = model.decoding(options)
        if kind != "text":
            return await native_markup(fields, record, texts, one, kind, model, pair, decode)
        constraints = request_phrases(fields.get("constraints"), texts, one, decode, model.batcher.tokenizer(pair))
        began = time.monotonic()
        results = await model.translate(texts, decode, pair, constraints)
        record.update(model=model.name, sentences=sum(len(found) for _, found in results), text=texts)
        return {
            "model": model.name,
            "translations": [
                {
                    "text": model.joined(pieces, found),
                    "sentences": _sentences(found, decode),
                }
                for pieces, found in results
            ],
            "decoding": decode.describe(),
            "seconds": round(time.monotonic() - began, 4),
        }

    async def native_markup(fields, record, texts, one, kind, model, pair, decode):
        """/v1/translate of HTML or XML: each translation's text is the markup translated, with its report."""
        if fields.get("constraints") is not None:
            raise HTTPError(400, f"constraints: not taken with format {kind!r} (a text of markup has many sentences)")
        if decode.n_best > 1:
            raise HTTPError(400, f"options.n_best {decode.n_best}: format {kind!r} gives one translation of a text")
        rules = markup.rules_for(kind, markup.bool_field(fields, "keep_attributes"))
        decode = markup.aligned_decoding(model, decode)
        began = time.monotonic()
        done = await markup.translate(model, texts, decode, pair, rules=rules, field="text", one=one,
                                      target_language=markup.target_code(model, fields.get("target")))  # fmt: skip
        record.update(model=model.name, sentences=sum(len(found) for _, _, found in done), text=texts)
        return {
            "model": model.name,
            "format": kind,
            "translations": [
                {
                    "text": text,
                    "markup": report.to_dict(),
                    "sentences": _sentences(found, decode),
                }
                for text, report, found in done
            ],
            "decoding": decode.describe(),
            "seconds": round(time.monotonic() - began, 4),
        }

    async def languages(fields, record):
        return service.listing()

    async def detect(fields, record):
        texts, _ = texts_field(fields, "q")
        ranked = await service.detect(texts, n=3)
        return [{"confidence": c, "language": code} for code, c in ranked]

    async def health(fields, record):
        return service.health()

    async def metrics(fields, record):
        body, kind = service.metrics.render()
        return Response(body, media_type=kind)

    routes = [
        Route("/translate", checked(translate, "/translate"), methods=["POST"]),
        Route("/languages", checked(languages, "/languages", keyed=False, limited=False), methods=["GET", "POST"]),
        Route("/detect", checked(detect, "/detect"), methods=["POST"]),
        Route("/v1/translate", checked(native, "/v1/translate"), methods=["POST"]),
        Route("/health", checked(health, "/health", keyed=False, limited=False), methods=["GET"]),
        Route("/metrics", checked(metrics, "/metrics", keyed=False, limited=False), methods=["GET"]),
    ]

    async def not_here(request, error):  # 404, 405 and the like: JSON as every other answer
        return JSONResponse({"error": error.detail}, status_code=error.status_code, headers=error.headers)

    return Starlette(routes=routes, exception_handlers={HTTPException: not_here})


def _sentences(found, decode) -> list[dict]:
    """The native answer's sentences: each one's source and hypotheses (without alignments, as the answer was)."""
    unasked = () if decode.alignments else ("alignment",)
    return [
        {
            "source": t.source,
            "hypotheses": [{k: v for k, v in dataclasses.asdict(h).items() if k not in unasked} for h in t.hypotheses],
        }  # fmt: skip
        for t in found
    ]


def _characters(fields: Fields) -> int:
    """The characters a request asks to translate (its q or text: a string or a list of them)."""
    value = fields.get("q", fields.get("text"))
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(len(v) for v in value if isinstance(v, str))
    return 0
