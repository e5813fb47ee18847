"""What the sub-commands write: lines to stdout, flushed as they come (`say`), and stdout's descriptor for the
streams that bypass Python's buffer; a reader of stdout that went away (`translate | head`)."""

from __future__ import annotations

import sys


def say(text: str = "") -> None:
    print(text, flush=True)


def fileno(stream) -> int | None:
    """The file descriptor behind a stream; None for one without (a test's io.StringIO)."""
    try:
        return stream.fileno()
    except (OSError, AttributeError, ValueError):
        return None


def stdout_closed() -> bool:
    """stdout is a pipe whose reader has gone (poll reports an error on it)."""
    import select

    fd = fileno(sys.stdout)
    if fd is None:
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poll.poll(0))


def discard_stdout() -> None:
    """stdout's descriptor pointed at /dev/null, so that what is still buffered for a closed pipe goes nowhere at
    exit (instead of a second BrokenPipeError there)."""
    import os

    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)
