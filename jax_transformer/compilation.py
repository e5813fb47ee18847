"""How the model's programs compile: `jit` compiles them with the XLA options of their compute dtype (a bfloat16
program rounds where the model says), `use_cache` turns on JAX's persistent compilation cache, `CompileJobs`
compiles a run's programs ahead in threads, and `CompileLog` counts compilations so a run reports compile time
apart from training time. Details: docs/internals.md#compilation."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax

OFF = "off"
# Programs that took this long or longer to compile go in the persistent cache (jax's own default: 1 s). A decoder's
# encoder and the programs its batches shrink to compile in 0.1-1 s each on a CPU: with jax's 1 s, a second
# `train.py translate` of 100 sentences compiled them again (10.0-12.1 s against 13.9-16.4 s without the cache, on
# a 2-core EPYC; with 0.1 s, 7.1-7.8 s). $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, where set, decides instead.
CACHE_MIN_COMPILE_S = 0.1
# jax.monitoring events (jax/_src/dispatch.py, compiler.py, compilation_cache.py in jax 0.10).
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",  # tracing the Python function (Flax modules included)
    "/jax/core/compile/jaxpr_to_mlir_module_duration",  # lowering to StableHLO
    "/jax/core/compile/backend_compile_duration",  # XLA's compile, or loading it from the persistent cache
)
_BACKEND_EVENT = _COMPILE_EVENTS[2]
_CACHE_HIT, _CACHE_MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


def compiler_options(dtype: str) -> dict[str, Any] | None:
    """XLA options for a program that computes in `dtype` (a config's compute dtype): None for float32; for a
    lower precision, excess precision off. With it on (XLA's default) XLA may drop a float32 -> bfloat16 -> float32
    pair of conversions and keep the float32 value; on a CPU, where bfloat16 arithmetic runs in float32 between
    such pairs, that skips most of the roundings the program asks for, in places that depend on how XLA fused it.
    A jitted bfloat16 model then computed other numbers than the same model run op by op, and than its PyTorch
    twin, enough to send a beam search down another path. Off, the program rounds exactly where it says."""
    return None if dtype == "float32" else {"xla_allow_excess_precision": False}


def jit(fn: Callable, dtype: str, *, cpu_options: Mapping | None = None, **jit_kwargs) -> Callable:
    """`jax.jit(fn, **jit_kwargs)` for a program computing in `dtype`, compiled with `compiler_options(dtype)`, and
    `cpu_options` besides where the backend is the CPU."""
    options = compiler_options(dtype)
    if cpu_options and jax.default_backend() == "cpu":
        options = {**(options or {}), **cpu_options}
    return jax.jit(fn, compiler_options=options, **jit_kwargs)


class jit_by_config:  # noqa: N801 (used as a decorator, like jax.jit)
    """A decorator: `fn`, whose `config` keyword argument is static, jitted with the compiler options of
    `config.dtype` (`compiler_options`), chosen at each call, and `cpu_options` besides where the backend is the CPU.
    `.lower` as for a jitted function."""

    def __init__(self, fn: Callable, *, static_argnames: tuple[str, ...], cpu_options: Mapping | None = None) -> None:
        functools.update_wrapper(self, fn)
        self._fn, self._static_argnames, self._cpu_options = fn, static_argnames, dict(cpu_options or {})
        self._jitted: dict[str, Callable] = {}
        self._lock = threading.Lock()  # compile-ahead threads may ask for the same dtype at once

    def _for(self, dtype: str) -> Callable:
        with self._lock:
            if dtype not in self._jitted:  # made at the first call, once the backend is known
                self._jitted[dtype] = jit(
                    self._fn, dtype, cpu_options=self._cpu_options, static_argnames=self._static_argnames
                )
            return self._jitted[dtype]

    def __call__(self, *args, config, **kwargs):
        return self._for(config.dtype)(*args, config=config, **kwargs)

    def lower(self, *args, config, **kwargs):
        return self._for(config.dtype).lower(*args, config=config, **kwargs)

    def _cache_size(self) -> int:
        """Programs compiled so far, both dtypes together (as jax's jitted functions count them)."""
        return sum(jitted._cache_size() for jitted in self._jitted.values())


def default_cache_dir() -> Path:
    """The per-user cache folder: $JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/jax_transformer/xla,
    else ~/.cache/jax_transformer/xla."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jax_transformer" / "xla"


def use_cache(setting: str | None, warn: Callable[[str], None] = print) -> Path | None:
    """Turns the persistent compilation cache on in the folder `setting` (None: `default_cache_dir()`), or off
    ("off"). Returns the folder in use, or None when off. A folder that cannot be created is a warning, not an
    error: a run never fails for want of a cache."""
    from jax.experimental.compilation_cache import compilation_cache

    current = jax.config.values["jax_compilation_cache_dir"]
    if setting == OFF:
        if current is not None:
            jax.config.update("jax_compilation_cache_dir", None)
            compilation_cache.reset_cache()  # jax opens its cache once per process; forget it
        return None
    folder = Path(setting).expanduser() if setting else default_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        warn(f"warning: compilation cache {folder} cannot be created ({e.strerror or e}); compiling without it")
        return None
    # XLA's autotuning results on GPUs, in a subfolder of the same cache (jax's default today; set so it stays on).
    jax.config.update("jax_persistent_cache_enable_xla_caches", "xla_gpu_per_fusion_autotune_cache_dir")
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_S)
    if current != str(folder):
        jax.config.update("jax_compilation_cache_dir", str(folder))
        compilation_cache.reset_cache()
    return folder


def cache_entries(folder: str | os.PathLike) -> int:
    """Compiled programs stored in a cache folder (jax writes one `<key>-cache` file per program)."""
    folder = Path(folder)
    return sum(1 for p in folder.iterdir() if p.name.endswith("-cache")) if folder.is_dir() else 0


class CompileLog:
    """Running totals of compilation in this process, from jax.monitoring: `compiles` (XLA compiles or cache
    loads), `seconds` (tracing + lowering + compiling, all threads), `thread_seconds` (those of the calling thread
    only: what it spent compiling rather than waiting for another thread), persistent cache `hits` and `misses`.
    One listener is registered per process (jax offers no way to scope one); differences of snapshots give what
    happened in between."""

    _lock = threading.Lock()
    _totals = {"compiles": 0, "seconds": 0.0, "hits": 0, "misses": 0}
    _by_thread: dict[int, float] = {}
    _registered = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._registered:
                return
            jax.monitoring.register_event_duration_secs_listener(cls._on_duration)
            jax.monitoring.register_event_listener(cls._on_event)
            cls._registered = True

    @classmethod
    def _on_duration(cls, event: str, seconds: float, **kwargs) -> None:
        if event in _COMPILE_EVENTS:  # reported by the thread that compiled
            thread = threading.get_ident()
            with cls._lock:
                cls._totals["seconds"] += seconds
                cls._totals["compiles"] += event == _BACKEND_EVENT
                cls._by_thread[thread] = cls._by_thread.get(thread, 0.0) + seconds

    @classmethod
    def _on_event(cls, event: str, **kwargs) -> None:
        if event in (_CACHE_HIT, _CACHE_MISS):
            with cls._lock:
                cls._totals["hits" if event == _CACHE_HIT else "misses"] += 1

    @classmethod
    def snapshot(cls) -> dict[str, float]:
        cls.install()
        with cls._lock:
            return {**cls._totals, "thread_seconds": cls._by_thread.get(threading.get_ident(), 0.0)}

    @staticmethod
    def since(before: Mapping[str, float]) -> dict[str, float]:
        now = CompileLog.snapshot()
        return {key: now[key] - before[key] for key in now}


class CompileJobs:
    """Compile jobs (each typically `lambda: jitted.lower(*args).compile()`) running in a pool of threads, started
    at once; `wait(names)` blocks until those are done. A run waits only for the program it needs next (the train
    step before the first step, the decoders before the first evaluation), while the others compile beside it:
    on a GPU the host's cores are otherwise idle. Compiling ahead is an optimisation, so a failed job is recorded
    in `errors` and left for the real call to report where it happens."""

    def __init__(self, jobs: Mapping[str, Callable[[], object]], threads: int | None = None) -> None:
        self.names = list(jobs)
        self.seconds: dict[str, float] = {}  # of each job that succeeded
        self.errors: dict[str, str] = {}
        self._pool = ThreadPoolExecutor(max(1, min(len(jobs), threads or os.cpu_count() or 1)), "compile")
        self._futures = {name: self._pool.submit(self._run, name, job) for name, job in jobs.items()}

    def _run(self, name: str, job: Callable[[], object]) -> None:
        start = time.perf_counter()
        try:
            job()
        except Exception as e:
            self.errors[name] = f"{type(e).__name__}: {e}"
        else:
            self.seconds[name] = time.perf_counter() - start

    def wait(self, names: Iterable[str] | None = None) -> None:
        for name in self.names if names is None else names:
            self._futures[name].result()

    def done(self) -> bool:
        return all(future.done() for future in self._futures.values())

    def close(self) -> None:
        """Drops the jobs not started yet (a compile under way cannot be interrupted; the process waits for it)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
