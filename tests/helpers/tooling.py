"""Test tooling: the hypothesis settings of every property test, and counting what XLA compiles."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


def fuzz(max_examples: int = 30):
    """The hypothesis settings of every property test: derandomized (the same examples on every run and machine,
    no example database), no deadline (hypothesis' 200 ms default would be a timing test), a few dozen examples
    (the suite's time budget), fixtures allowed (they are read, never changed, by the examples)."""
    from hypothesis import HealthCheck, settings

    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@contextlib.contextmanager
def compiled_functions() -> Iterator[list[tuple[str, str]]]:
    """Records every function XLA compiles (or loads from the persistent cache) inside the block as (its name, e.g.
    "jit(start)", the name of the thread that compiled it), from jax.monitoring's backend-compile events:
    compilations counted, not timed."""
    import threading

    import jax

    events: list[tuple[str, str]] = []

    def listen(event: str, seconds: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            events.append((str(kwargs.get("fun_name")), threading.current_thread().name))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def cpu_schedule(monkeypatch) -> None:
    """The CPU's decoding schedule (`schedule.Scheduled`: parts, shrinking batches, cache phases, encoder groups) as
    the default on any backend, through `monkeypatch` (pytest's fixture, or a pytest.MonkeyPatch context): a test of
    what it runs, and of the programs a run compiles for it, then holds on a GPU too."""
    from jax_transformer.decoding import schedule

    monkeypatch.setattr(schedule, "default", lambda: schedule.Scheduled())
