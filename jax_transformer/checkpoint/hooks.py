"""What orbax leaves behind when a checkpoint fails, quieted: installed by the command line before anything else
(stdlib only, so that parsing the flags loads no jax or orbax)."""

from __future__ import annotations

import sys


def quiet_closed_loop_callbacks() -> None:
    """When orbax fails to read or write a checkpoint, it closes its asyncio loop while tensorstore still has
    operations in flight; their completions then print "RuntimeError: Event loop is closed" tracebacks (through
    sys.unraisablehook or sys.excepthook) after the CheckpointError was reported. Exactly those are dropped."""
    if getattr(sys.unraisablehook, "quiets_closed_loop_callbacks", False):
        return

    def closed_loop_callback(kind, value, tb) -> bool:
        if kind is not RuntimeError or str(value) != "Event loop is closed":
            return False
        frames = []
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_name)
            tb = tb.tb_next
        return "call_soon_threadsafe" in frames

    previous_excepthook, previous_unraisablehook = sys.excepthook, sys.unraisablehook

    def excepthook(kind, value, tb):
        if not closed_loop_callback(kind, value, tb):
            previous_excepthook(kind, value, tb)

    def unraisablehook(unraisable):
        if not closed_loop_callback(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback):
            previous_unraisablehook(unraisable)

    unraisablehook.quiets_closed_loop_callbacks = True
    sys.excepthook, sys.unraisablehook = excepthook, unraisablehook
