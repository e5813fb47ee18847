"""What an operator watches: `/metrics` in Prometheus' text format (prometheus_client, a registry of the service's
own) and one JSON access-log line per request (`AccessLog`: request id, route, status, sentences, milliseconds; the
text itself only with --log-requests)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

access_log = logging.getLogger("jax_transformer.serving.access")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    """The service's counters, histograms and gauges (names prefixed `jt_`). Gauges that are read off the service
    (queue depth, compilations since ready) call back when scraped."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("jt_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.latency = Histogram(
            "jt_request_seconds", "time from a request's arrival to its answer", ["route"], buckets=LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.sentences = Counter("jt_sentences", "sentences translated", ["model"], registry=r)
        self.tokens = Counter("jt_tokens", "tokens decoded", ["model", "side"], registry=r)
        self.batch_sentences = Histogram(
            "jt_batch_sentences", "sentences per decoded batch", ["model"], buckets=BATCH_BUCKETS, registry=r
        )
        self.batch_seconds = Histogram(
            "jt_batch_seconds", "time to decode one batch", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue = Gauge("jt_queue_sentences", "sentences waiting to be decoded", ["model"], registry=r)
        self.decoding = Gauge("jt_decoding_sentences", "sentences being decoded", ["model"], registry=r)
        self.compiles = Gauge(
            "jt_compilations_after_ready", "XLA compilations since the service said ready", registry=r
        )
        self.traces = Gauge("jt_traces_after_ready", "functions traced since the service said ready", registry=r)
        self.programs = Gauge("jt_programs_compiled_at_start", "programs compiled before ready", registry=r)
        self.refused = Counter("jt_refused", "requests refused by a limit", ["reason"], registry=r)

    def watch(self, model: str, waiting: Callable[[], float], busy: Callable[[], float]) -> None:
        self.queue.labels(model).set_function(waiting)
        self.decoding.labels(model).set_function(busy)

    def batch(self, model: str, sentences: int, source_tokens: int, target_tokens: int, seconds: float) -> None:
        self.sentences.labels(model).inc(sentences)
        self.tokens.labels(model, "source").inc(source_tokens)
        self.tokens.labels(model, "target").inc(target_tokens)
        self.batch_sentences.labels(model).observe(sentences)
        self.batch_seconds.labels(model).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class AccessLog:
    """One JSON line per request on the `jax_transformer.serving.access` logger: {"id", "route", "status",
    "sentences", "ms", "client"} (and "model" where one translated it), with "text" and "translation" only when
    `with_text` (--log-requests): a service that logs what people translate says so."""

    def __init__(self, with_text: bool) -> None:
        self.with_text = with_text

    def line(self, record: dict) -> None:
        if not self.with_text:
            record = {k: v for k, v in record.items() if k not in ("text", "translation")}
        access_log.info(json.dumps(record, ensure_ascii=False))


def now_ms(began: float) -> float:
    return round(1000 * (time.monotonic() - began), 1)
