"""The thread that owns a model: requests that arrive within a window share a batch, up to a token budget, and each
group of equal decoding options and languages decodes together (`translation.translations`, sorted by length as
`translate` sorts, on the service's schedule, so that its batch shapes are those compiled at start). A full queue
is refused, not grown. A request's sentences are tokenized once, by the caller, off the lock: the ids are counted
against the budget and decoded as they are."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jax_transformer.settings.config import DecodeConfig


class QueueFull(Exception):
    pass


class TooMany(Exception):
    """A request of more sentences than the whole queue holds: it could never be taken (413, not 503)."""


@dataclasses.dataclass
class Job:
    """Sentences of one request, decoded alike: their translations go to `future`."""

    sentences: list[str]
    encoded: list[np.ndarray]  # each sentence's ids + EOS (`translation.encode_sources`)
    decode: DecodeConfig
    languages: tuple[str | None, str | None]
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    constraints: list[list[str] | None] | None = None  # each sentence's phrases (checked by the caller), or None

    @property
    def key(self):
        return self.decode, self.languages

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.encoded)


class Batcher:
    """The thread that owns the model. `submit` queues a request's sentences (QueueFull past `max_queue`); the
    thread takes the first waiting request, waits `window_s` for others (or until `max_tokens` source tokens
    wait), and decodes each group of equal options and languages in one `translations` call. `on_batch(sentences,
    source tokens, target tokens, seconds)` is told of each batch (the service's metrics)."""

    def __init__(
        self,
        loaded,
        *,
        max_tokens: int,
        window_s: float,
        max_queue: int,
        schedule=None,
        name: str = "decoder",
        on_batch: Callable[[int, int, int, float], None] | None = None,
    ) -> None:
        self.loaded, self.max_tokens, self.window_s, self.max_queue = loaded, max_tokens, window_s, max_queue
        self.schedule, self.on_batch = schedule, on_batch
        self.jobs: collections.deque[Job] = collections.deque()
        self.waiting = 0  # sentences queued, not yet taken
        self.busy = 0  # sentences being decoded
        self.served = self.batches = 0
        self.closing = False
        self.lock = threading.Condition()
        self.tokenizers: dict[tuple, Any] = {}
        self._tokenizers_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Batcher:
        self.thread.start()
        return self

    def alive(self) -> bool:
        return self.thread.is_alive() and not self.closing

    def encode(self, sentences: Sequence[str], languages) -> list[np.ndarray]:
        """Each sentence's ids + EOS, as the decoding takes them (call it off the lock: it tokenizes)."""
        from jax_transformer.decoding.translation import encode_sources

        return encode_sources(self.tokenizer(tuple(languages)), list(sentences), self.loaded.config)

    def submit(
        self,
        sentences: list[str],
        decode: DecodeConfig,
        languages=(None, None),
        encoded: list[np.ndarray] | None = None,
        constraints: list[list[str] | None] | None = None,
    ) -> concurrent.futures.Future:
        """Queues a request's sentences (`encoded`: their ids, `encode`'s, made by the caller off the lock;
        `constraints`: each sentence's phrases, or None)."""
        languages = tuple(languages)
        if len(sentences) > self.max_queue:
            raise TooMany(
                f"the request holds {len(sentences)} sentences, more than this service queues ({self.max_queue}): "
                f"send them in several requests"
            )
        job = Job(list(sentences), encoded if encoded is not None else self.encode(sentences, languages), decode,
                  languages, constraints=constraints)  # fmt: skip
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
        with self._tokenizers_lock:  # request threads and the decoder ask at once
            if languages not in self.tokenizers:
                from jax_transformer.data.tokenizer import with_languages

                self.tokenizers[languages] = with_languages(self.loaded.tokenizer, *languages)
            return self.tokenizers[languages]

    def _take(self) -> list[Job] | None:
        """The next batch: the first waiting job and those that join it within the window, up to the budget."""
        with self.lock:
            while not self.jobs:
                if self.closing:
                    return None
                self.lock.wait()
            taken = [self.jobs.popleft()]
            tokens, sentences = taken[0].tokens, len(taken[0].sentences)
            self.waiting -= sentences
            self.busy += sentences
            deadline = time.monotonic() + self.window_s
            while tokens < self.max_tokens and not self.closing:
                if not self.jobs:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.lock.wait(left)
                    continue
                job = self.jobs.popleft()
                tokens, sentences = tokens + job.tokens, sentences + len(job.sentences)
                self.waiting -= len(job.sentences)
                self.busy += len(job.sentences)
                taken.append(job)
            return taken

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
                began = time.monotonic()
                try:
                    found = translations(
                        self.loaded.params,
                        self.loaded.config,
                        self.tokenizer(languages),
                        [s for job in jobs for s in job.sentences],
                        decode,
                        max_tokens=self.max_tokens,  # batches by the same budget (rows x padded width)
                        progress=False,
                        schedule=self.schedule,
                        encoded=[ids for job in jobs for ids in job.encoded],
                        constraints=_constraints(jobs),
                    )
                except Exception as e:  # noqa: BLE001 (the request gets the error; the service goes on)
                    for job in jobs:
                        job.future.set_exception(e)
                else:
                    start = 0
                    for job in jobs:
                        job.future.set_result(found[start : start + len(job.sentences)])
                        start += len(job.sentences)
                    if self.on_batch is not None:
                        targets = sum(len(t.hypotheses[0].tokens) if t.hypotheses else 0 for t in found)
                        self.on_batch(len(found), sum(job.tokens for job in jobs), targets, time.monotonic() - began)
            with self.lock:
                done = sum(len(job.sentences) for job in taken)
                self.busy -= done
                self.served += done
                self.batches += len(groups)


def _constraints(jobs: Sequence[Job]) -> list[list[str] | None] | None:
    """The group's phrases, one list (or None) per sentence; None where no job has any."""
    if not any(job.constraints for job in jobs):
        return None
    return [c for job in jobs for c in (job.constraints or [None] * len(job.sentences))]
