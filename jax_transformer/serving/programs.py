"""The programs a service runs, all known when it starts: the decodings it allows (`Allowed`: its own, and what the
operator adds with --allow), each at every batch shape its batcher makes (`translation.budget_shapes`), compiled
before it says ready (`warm_up`); after that, `CompileWatch` counts any compilation (jax's own compile events), which
should stay at zero whatever the requests.

Which decoding options change a program is read off the decoder itself (`signature`: the static part of its rules,
its output length and rows per sentence, at every source width), not kept in a second list: alpha, temperature,
top_p, the seed, min_length, the forced first token and the repetition penalty's value are arguments of one program,
so any value runs without compiling; beam_size, rules, max_length, no_repeat_ngram_size, top_k, banned, ... are
parts of a program, so a request may ask only for the values the service compiled.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax_transformer.errors import ConfigError
from jax_transformer.settings.config import DecodeConfig, TransformerConfig
from jax_transformer.settings.resolve import allowed_decodings, with_field_of


def _parse_value(field: dataclasses.Field, kind: type, text: str, origin: str) -> Any:
    text = text.strip()
    if text.lower() == "none" and field.default is None:
        return None
    try:
        if kind is bool:
            if text.lower() not in ("true", "false"):
                raise ValueError
            return text.lower() == "true"
        return kind(text)
    except ValueError:
        raise ConfigError(f"{origin}: {field.name} {text!r} is not a {kind.__name__}") from None


def parse_allow(allow: str, origin: str = "--allow") -> dict[str, list[Any]]:
    """`FIELD=V1,V2 FIELD=V3` (DecodeConfig's field names, separated by spaces) as {field: [values]}; an unknown
    field or a value of the wrong type is a ConfigError naming it."""
    import typing

    fields = {f.name: f for f in dataclasses.fields(DecodeConfig)}
    hints = typing.get_type_hints(DecodeConfig)
    out: dict[str, list[Any]] = {}
    for item in allow.split():
        name, sep, values = item.partition("=")
        if not sep or not values:
            raise ConfigError(f"{origin} {item!r}: expected FIELD=VALUE[,VALUE...], e.g. no_repeat_ngram_size=0,3")
        if name not in fields:
            raise ConfigError(f"{origin} {item!r}: {name!r} is not a decoding setting; known: {', '.join(fields)}")
        kind = next(t for t in typing.get_args(hints[name]) or (hints[name],) if t is not type(None))
        for text in values.split(","):
            value = _parse_value(fields[name], kind, text, f"{origin} {item!r}")
            if value not in out.setdefault(name, []):
                out[name].append(value)
    return out


def signature(config: TransformerConfig, decode: DecodeConfig, widths: Sequence[int]) -> tuple:
    """What of `decode` its programs are compiled from, at each source width: the static part of its rules (jax's
    tree structure holds it), the length of its outputs and the rows it decodes per sentence. Two decodings of one
    signature run the same programs."""
    import jax

    from jax_transformer.decoding.decoders import decoder

    out = []
    for width in widths:
        found = decoder(config, decode, width)
        out.append((str(jax.tree.structure(found.rules)), found.length, found.samples, found.phrase_size))
    return tuple(out)


class Allowed:
    """The decodings a service runs: its own (`base`) and every combination of the values --allow adds, field by
    field, that is a valid decoding. `decodes` holds one of each signature, the set the service compiles; `check`
    says whether a request's decoding is among them, else names the option at fault and what is allowed."""

    def __init__(self, config: TransformerConfig, base: DecodeConfig, allow: Mapping[str, list[Any]]) -> None:
        from jax_transformer.decoding.translation import decode_widths

        self.config, self.base, self.widths = config, base, decode_widths(config.max_len)
        self.values = {name: list(dict.fromkeys([getattr(base, name), *values])) for name, values in allow.items()}
        self.decodes: list[DecodeConfig] = []
        self.signatures: dict[tuple, DecodeConfig] = {}
        combinations, refused = allowed_decodings(base, self.values)
        for decode in combinations:
            try:
                key = signature(config, decode, self.widths)
            except ValueError as e:  # a decoder's own check (a beam too wide for the vocabulary)
                refused.append(f"{decode.describe()}: {e}")
                continue
            if key not in self.signatures:
                self.signatures[key] = decode
                self.decodes.append(decode)
        if not self.decodes:  # (the base alone is valid: it was checked when the service resolved it)
            raise ConfigError("--allow: no combination is a valid decoding: " + "; ".join(refused[:3]))
        self._lock = threading.Lock()
        self._known: dict[DecodeConfig, tuple] = {}  # signatures of decodings seen, bounded below

    def _signature(self, decode: DecodeConfig) -> tuple:
        with self._lock:
            found = self._known.get(decode)
        if found is None:
            found = signature(self.config, decode, self.widths)
            with self._lock:
                if len(self._known) > 4096:  # requests may send any number of run-time values
                    self._known.clear()
                self._known[decode] = found
        return found

    def allows(self, decode: DecodeConfig) -> bool:
        return self._signature(decode) in self.signatures

    def fault(self, decode: DecodeConfig, given: Mapping[str, Any], field: str) -> str | None:
        """None if `decode` runs on compiled programs; else a message naming the option at fault (the first of
        `given` that alone leads outside the set) and the values allowed, or the combination."""
        if self.allows(decode):
            return None
        for name in given:  # the first option whose value is not listed and is part of the program
            value = getattr(decode, name, None)
            if value in self.values.get(name, [getattr(self.base, name, None)]):
                continue
            try:
                runtime = self._signature(with_field_of(decode, self.base, name)) == self._signature(decode)
            except (ConfigError, ValueError):
                runtime = False
            if not runtime:
                allowed = ", ".join(repr(v) for v in self.values.get(name, [getattr(self.base, name)]))
                return (
                    f"{field}.{name} {value!r}: this service does not run it (it compiles its programs at start); "
                    f"allowed: {allowed}"
                )
        described = ", ".join(f"{name}={getattr(decode, name)!r}" for name in given)
        return (
            f"{field}: {described}: this combination is not among the decodings this service runs ({self.describe()})"
        )

    def describe(self) -> str:
        if not self.values:
            return "its own decoding only"
        return "; ".join(f"{name}: {', '.join(repr(v) for v in values)}" for name, values in self.values.items())


class CompileWatch:
    """Compilations from the moment `ready()` is called, from jax's compile events (`compilation.CompileLog`):
    what a request had to wait for."""

    def __init__(self) -> None:
        from jax_transformer.compilation import CompileLog

        self._log = CompileLog
        self._log.install()
        self._at: dict[str, float] | None = None

    def ready(self) -> None:
        import jax

        self._at = self._log.snapshot()
        if not getattr(CompileWatch, "_listening", False):  # (jax offers no way to remove a listener: one a process)
            CompileWatch._listening = True
            jax.monitoring.register_event_duration_secs_listener(self._said)

    def _said(self, event: str, seconds: float, **kwargs) -> None:
        """Says which program compiled after ready (one line each: an operator sees what the list missed)."""
        import logging

        if self._at is not None and event == "/jax/core/compile/backend_compile_duration":
            logging.getLogger("jax_transformer.serving").warning(
                "compiled after ready: %s (%.2f s)", kwargs.get("fun_name", "a program"), seconds
            )

    def since_ready(self) -> dict[str, float]:
        now = self._log.snapshot()
        if self._at is None:
            return {"compiles": 0, "traces": 0}
        return {key: now[key] - self._at[key] for key in ("compiles", "traces")}


def warm_up(jobs: Mapping[str, Callable[[], Any]], *, threads: int | None = None) -> tuple[int, float, dict[str, str]]:
    """Runs the compile jobs with a progress bar: (programs compiled, seconds, errors by name)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from tqdm.auto import tqdm

    began = time.monotonic()
    errors: dict[str, str] = {}

    def run(name: str, job: Callable[[], Any]) -> None:
        try:
            job()
        except Exception as e:  # noqa: BLE001 (reported after the bar, each by name)
            errors[name] = f"{type(e).__name__}: {e}"

    import os

    with ThreadPoolExecutor(max(1, threads or os.cpu_count() or 1), "compile") as pool:
        futures = [pool.submit(run, name, job) for name, job in jobs.items()]
        with tqdm(total=len(futures), desc="compiling", unit="program", mininterval=1.0) as bar:
            for _ in as_completed(futures):
                bar.update()
    return len(jobs), time.monotonic() - began, errors
