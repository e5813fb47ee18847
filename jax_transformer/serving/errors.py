"""What a request is answered with when it is not a translation."""

from __future__ import annotations

EXTRA = "pip install -e '.[serve]'"


class HTTPError(Exception):
    """An answer other than 200: its status and the message of its JSON body."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}
