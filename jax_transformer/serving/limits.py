"""Per-client limits, as LibreTranslate's --req-limit and --char-limit: requests per minute and characters per
request, counted by API key where the request carries one, else by the client's address. The table of clients is
bounded: a client whose last request is a minute old is forgotten, and past `MAX_CLIENTS` the oldest go first."""

from __future__ import annotations

import collections
import math
import threading
import time

from jax_transformer.serving.errors import HTTPError

WINDOW_S = 60.0
MAX_CLIENTS = 100_000  # clients remembered at once (about 100 bytes each)


class ClientLimits:
    """`check(client, characters)` raises HTTPError 429 (with Retry-After: the seconds until the client's oldest
    request of the window leaves it) past `per_minute` requests in the last minute, and 400 past `characters` per
    request (as LibreTranslate answers an over-long text: waiting does not make it shorter). 0: no limit."""

    def __init__(self, per_minute: int, characters: int, clock=time.monotonic) -> None:
        self.per_minute, self.characters, self.clock = per_minute, characters, clock
        self._seen: collections.OrderedDict[str, collections.deque[float]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def check(self, client: str, characters: int) -> None:
        if self.characters and characters > self.characters:
            raise HTTPError(
                400, f"Invalid request: request ({characters} characters) exceeds text limit ({self.characters})"
            )
        if not self.per_minute:
            return
        now = self.clock()
        with self._lock:
            times = self._seen.pop(client, None) or collections.deque()
            while times and times[0] <= now - WINDOW_S:
                times.popleft()
            if len(times) >= self.per_minute:
                self._seen[client] = times
                wait = max(1, math.ceil(times[0] + WINDOW_S - now))
                raise HTTPError(
                    429,
                    f"Too many requests: {self.per_minute} per minute allowed for this client; retry in {wait} s",
                    {"Retry-After": str(wait)},
                )
            times.append(now)
            self._seen[client] = times  # most recent last
            self._forget(now)

    def _forget(self, now: float) -> None:
        while self._seen:
            client, times = next(iter(self._seen.items()))
            if len(self._seen) <= MAX_CLIENTS and times and times[-1] > now - WINDOW_S:
                break
            del self._seen[client]

    def __len__(self) -> int:
        return len(self._seen)
