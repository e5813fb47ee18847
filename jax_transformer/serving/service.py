"""`train.py serve`: one process keeps one or several models and their compiled programs, and answers translations
over HTTP (the application: `serving.http`).

- `Model`: a model loaded to translate, its languages, the decodings it allows (`programs.Allowed`) and its
  `Batcher`, the thread that owns it.
- `Service`: what the handlers share: the models and the pair each serves (`route`), the detector, the key, the
  per-client limits, the metrics and the access log.
- `build`: a Service of models loaded already; `serve`: compiles every program each model may run (every allowed
  decoding at every batch shape), then listens (uvicorn on 127.0.0.1 unless told otherwise, its protocol held
  against slow clients: `serving.protocol`) until SIGTERM, which drops requests whose body has not arrived,
  answers the accepted ones, and exits.

Why Starlette and uvicorn (the `serve` extra): a small, maintained ASGI stack (FastAPI is built on it) with
graceful shutdown and request streaming, so the body limit holds before a body is read. A text is split into
sentences with the layout kept (`documents.Segmenter`) as LibreTranslate splits its input.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax_transformer.errors import ConfigError
from jax_transformer.serving.batcher import Batcher, QueueFull, TooMany
from jax_transformer.serving.errors import EXTRA, HTTPError
from jax_transformer.serving.languages import Languages, detector_for
from jax_transformer.serving.limits import ClientLimits
from jax_transformer.serving.metrics import AccessLog, Metrics
from jax_transformer.serving.programs import Allowed, CompileWatch, parse_allow, warm_up
from jax_transformer.settings.config import DecodeConfig, ServeConfig

log = logging.getLogger("jax_transformer.serving")
# Texts up to this many characters are split and tokenized on the event loop (tens of microseconds a sentence);
# longer ones in a worker thread, so that a long document does not hold the other requests up. A hop to a worker
# and back costs two handovers of the GIL, each of which can wait for a decoding thread's Python work.
INLINE_CHARS = 2000
SWITCH_INTERVAL_S = 0.0005


# =============================================================================================================
# A served model
# =============================================================================================================


def joined(pieces, translations, rank: int = 0) -> str:
    """The text with each sentence replaced by its `rank`-th translation ("" where it has fewer), joined as
    `translate --document` joins a document (`documents.joined`)."""
    from jax_transformer.decoding import documents

    return documents.joined(pieces, (t.hypotheses[rank].text if rank < len(t.hypotheses) else "" for t in translations))


@dataclasses.dataclass
class Model:
    """A model the service translates with: its weights and decoding (`loaded`, `decode`), languages, the decodings
    a request may ask for (`allowed`), its batcher and its sentence splitters."""

    name: str
    loaded: Any
    decode: DecodeConfig
    languages: Languages
    allowed: Allowed
    batcher: Batcher
    settings: ServeConfig
    segmenters: dict[str, Any] = dataclasses.field(default_factory=dict)
    glossary: Any = None  # --glossary's `decoding.glossary.Glossary`: every sentence's terms become its constraints
    joined = staticmethod(joined)

    def decoding(self, options: Any, field: str = "options") -> DecodeConfig:
        """The request's decoding: the fields given (DecodeConfig's names) over the model's, by the rules the
        flags follow (`settings.resolve.request_decoding`), if it is among the decodings this service compiled."""
        from jax_transformer.settings.resolve import request_decoding

        if options is None:
            return self.decode
        if not isinstance(options, dict):
            raise HTTPError(400, f"{field}: expected an object of decoding settings, got {_json_type(options)}")
        options = dict(options)
        for name, value in options.items():
            if name == "banned" and isinstance(value, list):  # ids as a JSON list, as a client would send them
                if not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
                    raise HTTPError(400, f"{field}.banned: expected token ids (whole numbers), got {value!r}"[:200])
                options[name] = ",".join(str(i) for i in value)
            elif isinstance(value, (list, dict)):
                raise HTTPError(400, f"{field}.{name}: expected one value, got {_json_type(value)}")
        if not options:
            return self.decode
        try:
            decode = request_decoding(self.loaded.config, self.decode, options, field)
        except (ConfigError, TypeError, ValueError) as e:
            raise HTTPError(400, _request_message(str(e), field)) from None
        most = self.settings.max_beam
        for name, value in (("beam_size", decode.beams), ("n_best", decode.n_best)):  # sampling keeps one beam
            if value > most:
                raise HTTPError(400, f"{field}.{name} {value}: more than this service allows ({most})")
        fault = self.allowed.fault(decode, options, field)
        if fault is not None:
            raise HTTPError(400, fault)
        if decode.suppress != self.decode.suppress:  # banned phrases' arrays are shapes the service did not compile
            raise HTTPError(400, f"{field}.suppress: this service does not take banned phrases per request")
        return decode

    def pair(self, source: str, target: str) -> tuple[str | None, str | None]:
        """The tokenizer's languages for a pair of the model's codes ((None, None) for a model without codes)."""
        return (source, target) if self.languages.multilingual else (None, None)

    def __post_init__(self) -> None:
        # A sentence's ids are wanted twice, by the splitter (does it fit?) and by the decoding: tokenized once.
        self.source_ids = functools.lru_cache(maxsize=8192)(self._source_ids)

    def _source_ids(self, pair: tuple, sentence: str) -> tuple[int, ...]:
        return tuple(self.batcher.tokenizer(pair).encode(sentence))

    def segmenter(self, pair: tuple):
        """A source language's splitter; a sentence must fit with its code (if any)."""
        if pair not in self.segmenters:
            from jax_transformer.decoding.documents import Segmenter

            most = self.loaded.config.max_len
            fits = lambda sentence: len(self.source_ids(pair, sentence)) + 1 <= most  # noqa: E731 (EOS too)
            self.segmenters[pair] = Segmenter(pair[0] or self.languages.sources[0], fits)
        return self.segmenters[pair]

    def encode(self, sentences: list[str], pair: tuple) -> list:
        """Each sentence's ids + EOS, as the decoding takes them (`translation.encode_sources`'s convention)."""
        import numpy as np

        from jax_transformer.errors import TokenError

        config, out = self.loaded.config, []
        for sentence in sentences:
            ids = self.source_ids(pair, sentence)
            if len(ids) + 1 > config.max_len:  # (the splitter cut what it could; a piece it could not cut)
                raise TokenError(f"a sentence has {len(ids)} tokens + EOS, more than the model's {config.max_len}")
            out.append(np.array([*ids, config.eos_id], dtype=np.int32))
        return out

    async def translate(
        self, texts: list[str], decode: DecodeConfig, pair, constraints: list | None = None, split: bool = True
    ) -> list[tuple[Any, list]]:
        """Each text's sentences (their pieces, layout kept) with their `Translation`s: [(pieces, translations)].
        `constraints`: each text's phrases, checked (`steering.request_phrases`), or None; the glossary's terms are
        added to every sentence's (`steering.sentence_phrases`). `split` False: each text is one sentence, as it is
        (markup's sentences, cut already)."""

        def prepare():  # splitting and tokenizing, off the batcher's lock
            from jax_transformer.decoding.documents import Piece

            segmenter = self.segmenter(pair)
            pieces = [segmenter.split(text) if split else [Piece(text, True)] for text in texts]
            sentences = [piece.text for each in pieces for piece in each if piece.sentence]
            encoded = self.encode(sentences, pair)
            phrases = None
            if constraints is not None or self.glossary is not None:
                from jax_transformer.decoding.decoders import decoder
                from jax_transformer.serving.steering import sentence_phrases

                limits = decoder(self.loaded.config, decode, self.loaded.config.max_len).limits
                rooms = [int(limits(ids[None])[0]) for ids in encoded]
                tokenizer = self.batcher.tokenizer(pair)
                phrases = sentence_phrases(pieces, constraints, self.glossary, decode, tokenizer, rooms)
            return pieces, sentences, encoded, phrases

        if sum(map(len, texts)) <= INLINE_CHARS:  # a thread hop costs more than tokenizing a few sentences
            pieces, sentences, encoded, phrases = prepare()
        else:
            pieces, sentences, encoded, phrases = await asyncio.to_thread(prepare)
        try:
            future = self.batcher.submit(sentences, decode, pair, encoded, phrases) if sentences else None
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

    def memory_bytes(self) -> int:
        import jax

        return sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree.leaves(self.loaded.params))


def _json_type(value: Any) -> str:
    return {list: "a list", dict: "an object", str: "a string", bool: "true/false", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _request_message(message: str, field: str) -> str:
    """A settings error said to an HTTP client: once prefixed by the field, in its names, not the flags'."""
    import re

    message = re.sub(r"\s*\(decode field '[a-z_]+'\)", "", message)
    message = re.sub(r"decode field '([a-z_]+)'", rf"{field}.\1", message)
    message = re.sub(r"--([a-z][a-z0-9-]*)", lambda m: f"{field}.{m.group(1).replace('-', '_')}", message)
    for named in set(re.findall(rf"\(({re.escape(field)}\.[a-z_]+)\)", message)):  # "x.alpha ... (x.alpha)": once
        if message.find(named) < message.find(f"({named})"):
            message = message.replace(f" ({named})", "")
    return message if message.startswith(field) else f"{field}: {message}"


# =============================================================================================================
# The service: models by pair
# =============================================================================================================


@dataclasses.dataclass
class Entry:
    """A model to serve: its name, its loaded form (`decoding.translator.Translator`) and the pairs it serves
    ("src-tgt" in any codes the model takes; None: every pair of its languages)."""

    name: str
    translator: Any
    pairs: list[str] | None = None
    origin: str = "--checkpoint"  # where it was named (models.json's entry), for messages


@dataclasses.dataclass
class Service:
    """What the handlers share (see the module's docstring)."""

    models: list[Model]
    settings: ServeConfig
    routes: dict[tuple[str, str], Model]  # (source, target) as clients see the codes -> the model serving it
    limits: ClientLimits
    metrics: Metrics
    access: AccessLog
    watch: CompileWatch
    detector: Any = None
    detection_off: str = ""  # why there is no detector
    api_key: str | None = None
    detected: Languages | None = None  # every model's source languages, which the detector tells apart
    stopping: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    readers: set = dataclasses.field(default_factory=set)  # the tasks reading a request's body
    programs: int = 0  # compiled at start

    def model(self, name: Any) -> Model:
        for model in self.models:
            if model.name == name:
                return model
        raise HTTPError(400, f"model {name!r} is not served here (models: {', '.join(m.name for m in self.models)})")

    def route(self, source: Any, target: Any, model: Any = None, native: bool = False) -> tuple[Model, tuple]:
        """The model of the pair a request asks for, and the tokenizer's languages: by the request's `model`
        (native API) or by the pair, each code a model's own or a BCP 47 tag."""
        candidates = [self.model(model)] if model is not None else self.models
        if len(candidates) == 1:
            found = candidates[0]
            if native and not found.languages.multilingual:  # a model of one pair: its own unless given
                source = found.languages.sources[0] if source is None else source
                target = found.languages.targets[0] if target is None else target
            src, tgt = (
                found.languages.code(source, "source", "source"),
                found.languages.code(target, "target", "target"),
            )
            if self.routes.get(_short(found, src, tgt)) is found:
                return found, found.pair(src, tgt)
            raise HTTPError(400, f"model {found.name!r} does not serve {source}-{target} here")
        known = 0
        for found in self.models:
            try:
                src = found.languages.code(source, "source", "source")
                tgt = found.languages.code(target, "target", "target")
            except HTTPError:
                continue
            known += 1
            key = _short(found, src, tgt)
            owner = self.routes.get(key)
            if owner is found:
                return found, found.pair(src, tgt)
            if owner is not None:
                codes = (
                    owner.languages.code(key[0], "source", "source"),
                    owner.languages.code(key[1], "target", "target"),
                )
                return owner, owner.pair(*codes)
        if not known:
            raise HTTPError(
                400, f"{source!r} to {target!r}: no model here has these languages (pairs: {self.pairs_text()})"
            )
        raise HTTPError(400, f"no model here translates {source} to {target} (pairs: {self.pairs_text()})")

    def pairs_text(self, most: int = 20) -> str:
        pairs = [f"{a}-{b}" for a, b in self.routes]
        return ", ".join(pairs[:most]) + (f", ... ({len(pairs)} in all)" if len(pairs) > most else "")

    def listing(self) -> list[dict[str, Any]]:
        """LibreTranslate's /languages: [{"code", "name", "targets"}] per source language of any model."""
        import langcodes

        targets: dict[str, list[str]] = {}
        for src, tgt in self.routes:
            targets.setdefault(src, []).append(tgt)
        out = []
        for code, reachable in targets.items():
            try:
                name = langcodes.Language.get(code.replace("_", "-")).display_name()
            except (ValueError, LookupError, ImportError):  # (names need the language_data package)
                name = code
            out.append({"code": code, "name": name, "targets": reachable})
        return out

    async def detect(self, texts: list[str], n: int = 1) -> list[tuple[str, float]] | tuple[str, float]:
        """The most likely source languages of the texts as clients name them: [(code, confidence)] (n > 1), or
        the best one alone (n = 1)."""
        if self.detector is None:
            raise HTTPError(400, f"language detection is off: {self.detection_off}")
        ranked = await asyncio.to_thread(self.detector.detect, " ".join(texts), n)
        ranked = [(self.detected.short([code])[0], confidence) for code, confidence in ranked]
        return ranked if n > 1 else ranked[0]

    def health(self) -> dict[str, Any]:
        alive = all(m.batcher.alive() for m in self.models)
        since = self.watch.since_ready()
        status = "stopping" if self.stopping.is_set() else "ok" if alive else "stopped"
        total = lambda attr: sum(getattr(m.batcher, attr) for m in self.models)  # noqa: E731
        return {
            "status": status,
            "models": {
                m.name: {
                    "checkpoint": str(m.loaded.directory),
                    "step": m.loaded.step,
                    "waiting": m.batcher.waiting,
                    "decoding": m.batcher.busy,
                    "served": m.batcher.served,
                    "batches": m.batcher.batches,
                }
                for m in self.models
            },
            "model": str(self.models[0].loaded.directory),
            "step": self.models[0].loaded.step,
            "waiting": total("waiting"),
            "decoding": total("busy"),
            "served": total("served"),
            "batches": total("batches"),
            "programs_compiled_at_start": self.programs,
            "compilations_after_ready": since["compiles"],
            "traces_after_ready": since["traces"],
        }


def _split_pair(languages: Languages, text: str) -> tuple[str, str] | None:
    """A "SRC-TGT" text as the model's codes: the first cut at a "-" where both sides are its languages (a side may
    hold a "-" itself: pt-BR-en)."""
    parts = text.split("-")
    for cut in range(1, len(parts)):
        try:
            src = languages.code("-".join(parts[:cut]), "source", "source")
            tgt = languages.code("-".join(parts[cut:]), "target", "target")
        except HTTPError:
            continue
        return src, tgt
    return None


def _short(model: Model, src: str, tgt: str) -> tuple[str, str]:
    """A pair of the model's codes as clients see them (the key of `Service.routes`)."""
    a, b = model.languages.short([src, tgt])
    return a, b


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


def _routes(models: Sequence[Model], entries: Sequence[Entry], prefer: Mapping[str, str]) -> dict:
    """(source, target) -> model, as clients see the codes: each model's pairs; a pair two models claim is an error
    naming both, unless `prefer` ("src-tgt": model name) says which serves it."""
    routes: dict[tuple[str, str], Model] = {}
    for model, entry in zip(models, entries):
        langs = model.languages
        if entry.pairs is None:
            pairs = [(s, t) for s in langs.sources for t in langs.targets if s != t or not langs.multilingual]
        else:
            pairs = []
            for i, text in enumerate(entry.pairs):
                pair = _split_pair(langs, str(text))
                if pair is None:
                    raise ConfigError(
                        f"{entry.origin}: pairs[{i}] {text!r}: not SRC-TGT of this model's languages (e.g. "
                        f"{langs.short(langs.sources[:1])[0]}-{langs.short(langs.targets[-1:])[0]})"
                    )
                pairs.append(pair)
        shorts = dict(zip(langs.sources + langs.targets, langs.short(langs.sources + langs.targets)))
        for src, tgt in pairs:
            key = (shorts[src], shorts[tgt])
            other = routes.get(key)
            if other is not None and other is not model:
                chosen = prefer.get(f"{key[0]}-{key[1]}")
                if chosen not in (model.name, other.name):
                    raise ConfigError(
                        f"{key[0]}-{key[1]} is served by two models, {other.name!r} and {model.name!r}: list only one "
                        f'of them for it, or say which in the file\'s "prefer": {{"{key[0]}-{key[1]}": NAME}}'
                    )
                routes[key] = model if chosen == model.name else other
            else:
                routes[key] = model
    return routes


def build(
    entries: Entry | Sequence[Entry] | Any,
    settings: ServeConfig,
    *,
    prefer: Mapping[str, str] | None = None,
    detect: bool = True,
    api_key: str | None = None,
) -> Service:
    """The service of models loaded to translate (`Entry`s, or one `decoding.translator.Translator`): each one's
    languages, allowed decodings and batcher (not started), the routes by pair, the detector (where py3langid is
    installed), key, limits and metrics. `api_key`: read already (`read_api_key`: a pipe is read once); else
    --api-key-file's, read here."""
    from jax_transformer.decoding import schedule as schedules

    if isinstance(entries, Entry):
        entries = [entries]
    elif not isinstance(entries, Sequence):  # one Translator
        entries = [Entry("default", entries)]
    allow = parse_allow(settings.allow)
    metrics = Metrics()
    models = []
    for entry in entries:
        loaded, decode = entry.translator.served, entry.translator.decode  # an ensemble's: its config and weights
        if decode.suppress:  # banned phrases' arrays are shapes the compile-ahead does not make yet
            raise ConfigError(
                f"{entry.origin}: suppress {decode.suppress!r}: a service does not ban phrases yet (their programs "
                f"would compile after it says ready); translate --suppress does"
            )
        given = settings.languages if len(entries) == 1 else None
        if not hasattr(loaded.tokenizer, "codes") and entry.pairs:  # a model of one pair: the pair its entry names
            if len(entry.pairs) != 1:
                raise ConfigError(
                    f"{entry.origin}: pairs: a model without language codes serves one pair, got {entry.pairs}"
                )
            given = entry.pairs[0]
        languages = Languages.of(loaded, given)
        on_batch = lambda *args, name=entry.name: metrics.batch(name, *args)  # noqa: E731
        batcher = Batcher(
            loaded,
            max_tokens=settings.max_tokens,
            window_s=settings.batch_window_ms / 1000,
            max_queue=settings.max_queue,
            schedule=schedules.serving(),
            name=f"decoder {entry.name}",
            on_batch=on_batch,
        )
        allowed = Allowed(loaded.config, decode, allow)
        model = Model(entry.name, loaded, decode, languages, allowed, batcher, settings)
        metrics.watch(entry.name, lambda b=batcher: b.waiting, lambda b=batcher: b.busy)
        models.append(model)
    routes = _routes(models, entries, prefer or {})
    if settings.glossary:  # read and checked before anything compiles: a bad line or term is said at start
        from jax_transformer.decoding.glossary import Glossary
        from jax_transformer.serving.steering import check_glossary

        glossary = Glossary.read(settings.glossary)
        for model in models:
            src, tgt = next(((a, b) for (a, b), m in routes.items() if m is model), (None, None))
            pair = model.pair(
                model.languages.code(src, "source", "source"), model.languages.code(tgt, "target", "target")
            )
            check_glossary(glossary, model.decode, model.batcher.tokenizer(pair), settings.glossary)
            model.glossary = glossary
    detector, off = None, "detection is not asked for"
    detected = _all_sources(models)
    if detect:
        detector, off = detector_for(detected)
    watch = CompileWatch()
    metrics.compiles.set_function(lambda: watch.since_ready()["compiles"])
    metrics.traces.set_function(lambda: watch.since_ready()["traces"])
    service = Service(
        models,
        settings,
        routes,
        ClientLimits(settings.req_limit, settings.char_limit),
        metrics,
        AccessLog(settings.log_requests),
        watch,
        detector,
        off,
        api_key if api_key is not None else read_api_key(settings),
        detected,
    )
    return service


def _all_sources(models: Sequence[Model]) -> Languages:
    """The source languages of every model, each language once, as one model's would be (for detection)."""
    codes = []
    seen = set()
    for model in models:
        for code, short in zip(model.languages.sources, model.languages.short(model.languages.sources)):
            if short not in seen:
                seen.add(short)
                codes.append(code)
    return Languages(codes, codes, True)


# =============================================================================================================
# Running it
# =============================================================================================================


def compile_jobs(service: Service) -> tuple[dict[str, Callable[[], Any]], list[str]]:
    """Every program the service's models may run after it says ready, as compile jobs (merged: a program two
    decodings share compiles once), and a line per model saying what they are."""
    from jax_transformer.decoding import translation
    from jax_transformer.decoding.translation import weights_mesh

    jobs: dict[str, Callable[[], Any]] = {}
    lines = []
    for model in service.models:
        config = model.loaded.config
        mesh = weights_mesh(model.loaded.params)
        shapes = translation.budget_shapes(
            service.settings.max_tokens, config.max_len, 1 if mesh is None else mesh.shape["data"]
        )
        before = len(jobs)
        for decode in model.allowed.decodes:
            if mesh is not None:  # a mesh's programs compile at their first call: make it, on filler sources
                for rows, width in shapes:
                    jobs[f"{model.name} {decode} {rows}x{width}"] = _decode_once(model, decode, rows, width)
                continue
            for name, job in translation.compile_every_shape(
                model.loaded.params, config, decode, shapes, model.batcher.schedule
            ).items():
                jobs[f"{model.name}: {name}"] = job
        lines.append(
            f"model {model.name}: {len(model.allowed.decodes)} decoding(s) x {len(shapes)} batch shapes "
            f"(rows x width: {', '.join(f'{r}x{w}' for r, w in shapes)}): {len(jobs) - before} programs"
        )
    return jobs, lines


def _decode_once(model: Model, decode: DecodeConfig, rows: int, width: int) -> Callable[[], Any]:
    import numpy as np

    from jax_transformer.decoding.decoders import decoder
    from jax_transformer.decoding.translation import OverData, weights_mesh

    def job():
        config = model.loaded.config
        src = np.full((rows, width), config.pad_id, np.int32)
        src[:, 0] = config.eos_id
        decoder(config, decode, width)(model.loaded.params, src, OverData(weights_mesh(model.loaded.params)))

    return job


def describe(model: Model) -> str:
    mib = model.memory_bytes() / 2**20
    return f"model {model.name}: {model.loaded.directory} step {model.loaded.step}, {mib:,.1f} MiB of weights"


def serve(service: Service, print_fn: Callable[[str], None] = print) -> None:
    """Compiles every program, listens, and serves until SIGTERM or SIGINT (then drains, as the module says)."""
    import socket

    from jax_transformer.compilation import CompileLog
    from jax_transformer.serving.http import app
    from jax_transformer.serving.protocol import guarded_protocol, server_class

    try:
        import uvicorn
    except ImportError:
        raise ConfigError(f"serve needs uvicorn and starlette: {EXTRA}") from None
    _log_to_stderr()
    # The event loop takes the GIL back within this of asking (Python's default: 5 ms) while decoding threads run
    # their Python between programs: each request hands it over several times.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    settings = service.settings
    began = time.monotonic()
    for model in service.models:
        served = [f"{a}-{b}" for (a, b), m in service.routes.items() if m is model]
        shown = ", ".join(served[:8]) + (f", ... ({len(served)} pairs)" if len(served) > 8 else "")
        print_fn(f"{describe(model)}; serves {shown}; decodings: {model.allowed.describe()}")
    jobs, lines = compile_jobs(service)
    for line in lines:
        print_fn(line)
    before = CompileLog.snapshot()
    count, seconds, errors = warm_up(jobs)
    for name, error in list(errors.items())[:5]:
        print_fn(f"warning: compiling {name} failed ({error}); it compiles when first used")
    after = CompileLog.snapshot()
    service.programs = count
    service.metrics.programs.set(count)
    print_fn(
        f"compiled {count} programs in {seconds:.1f} s ({after['hits'] - before['hits']} read from the persistent "
        f"compilation cache)"
    )
    for model in service.models:
        model.batcher.start()
    first = CompileLog.snapshot()
    for model in service.models:  # one real request's path, end to end, as a check of the list above
        src, tgt = next((a, b) for (a, b), m in service.routes.items() if m is model)
        pair = model.pair(model.languages.code(src, "source", "source"), model.languages.code(tgt, "target", "target"))
        model.batcher.submit(["hello"], model.decode, pair).result()
    missed = CompileLog.snapshot()["compiles"] - first["compiles"]
    if missed:
        print_fn(f"warning: a first decoding compiled {missed} programs the list above did not hold")
    print_fn(f"ready in {time.monotonic() - began:.1f} s")
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as e:
        raise ConfigError(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}") from None
    host, port = sock.getsockname()[:2]
    per_client = settings.max_client_connections or max(1, settings.max_connections // 4)
    config = uvicorn.Config(
        app(service),
        log_level="warning",
        timeout_graceful_shutdown=settings.shutdown_timeout_s,
        limit_concurrency=settings.max_connections,
        http=guarded_protocol(settings.header_timeout_s, per_client),
        lifespan="off",
    )
    listening = f"serving http://{host}:{port} (LibreTranslate's /translate, /languages, /detect; /v1/translate; "
    listening += "/health, /metrics)"

    def on_listening():
        service.watch.ready()  # from here on, a compilation is one a request waits for
        print_fn(listening)

    def on_shutdown():  # requests whose body has not arrived are dropped (503), the rest answered
        service.stopping.set()
        for task in list(service.readers):
            task.cancel()

    server = server_class(on_listening, on_shutdown)(config)
    try:
        server.run(sockets=[sock])
    finally:
        for model in service.models:
            model.batcher.close(settings.shutdown_timeout_s)
        served = sum(m.batcher.served for m in service.models)
        batches = sum(m.batcher.batches for m in service.models)
        after = service.watch.since_ready()
        print_fn(
            f"stopped: {served} sentences served in {batches} batches; {after['compiles']} compilations after ready"
        )


def _log_to_stderr() -> None:
    """The service's log (its access log included) as lines on stderr, once."""
    logger = logging.getLogger("jax_transformer.serving")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
