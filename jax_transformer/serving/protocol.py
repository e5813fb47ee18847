"""uvicorn, held against slow and greedy clients: `guarded_protocol` is its HTTP/1.1 protocol (h11) with a deadline for
each request's headers (a connection that has sent no whole request head within --header-timeout-s of connecting,
or of its last answer, is closed) and a cap on the connections one client address holds at once (further ones are
closed as they open), so that sockets which send nothing cannot hold the connection slots. The body's own
deadline is the application's (`http.read_body`). `server_class` is uvicorn's Server that says when it listens,
keeps the process's exit status 0 on SIGTERM, and, as it shuts down, tells the application to drop requests whose
body has not arrived, so that it exits once the accepted requests are answered.

Why a subclass of uvicorn's own protocol: uvicorn (0.54) has a keep-alive timeout but none for a request head or
body, nor a per-client cap; the rest of its protocol (parsing by h11, flow control, graceful shutdown) stays its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

log = logging.getLogger("jax_transformer.serving")


def guarded_protocol(header_timeout_s: float, max_client_connections: int):
    """uvicorn's H11Protocol with a deadline on request heads and a per-address connection cap."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    held: dict[str, int] = {}  # open connections by client address (one event loop: no lock)

    class GuardedProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _address: str | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            address = self.client[0] if self.client else ""
            if held.get(address, 0) >= max_client_connections:
                log.info("closed a connection from %s: it holds %d already", address, max_client_connections)
                transport.close()
                return
            self._address = address
            held[address] = held.get(address, 0) + 1
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._address is not None:
                left = held.get(self._address, 1) - 1
                if left > 0:
                    held[self._address] = left
                else:
                    held.pop(self._address, None)
                self._address = None
            super().connection_lost(exc)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a whole request head arrived: the application reads the rest
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's head has its own deadline (uvicorn's keep-alive timer stops at
                # the first byte of it)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                log.info("closed a connection from %s: no request within %g s", self._address, header_timeout_s)
                self.transport.close()

    return GuardedProtocol


def server_class(on_listening: Callable[[], None], on_shutdown: Callable[[], None]):
    """uvicorn.Server that calls `on_listening` once it listens and `on_shutdown` as its shutdown begins (before
    it waits for the requests in flight)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if not self.should_exit:  # listening now: a client may connect once this is said
                on_listening()

        async def shutdown(self, sockets=None) -> None:
            on_shutdown()
            await super().shutdown(sockets=sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            # As uvicorn's, without raising the signal again once the requests in flight are answered: the batchers
            # still drain, and a graceful stop exits 0 (uvicorn would end the process by the signal itself).
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server
