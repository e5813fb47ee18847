"""How the model's programs compile: `jit` compiles them with the XLA options of their compute dtype (a bfloat16
program rounds where the model says), `use_cache` turns on JAX's persistent compilation cache (and, where asked,
`ProgramStore`, which skips tracing the decoders again), `CompileJobs` compiles a run's programs
ahead in threads, and `CompileLog` counts compilations so a run reports compile time apart from training time.
Details: docs/internals.md#compilation."""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import os
import platform
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax

from jax_transformer import files

OFF = "off"
_programs: ProgramStore | None = None  # the store of traced decoders, where use_cache(programs=True) turned it on
# Programs that took this long or longer to compile go in the persistent cache. jax's own default (1 s) leaves out
# a decoder's encoder and most programs a shrinking batch goes through, which a CPU compiles in less: a second
# `translate` compiled them again (docs/benchmarks.md). $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS decides instead.
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


def jitted_options(dtype: str, cpu_options: Mapping | None = None) -> dict[str, Any] | None:
    """`compiler_options(dtype)`, and `cpu_options` besides where the backend is the CPU."""
    options = compiler_options(dtype)
    if cpu_options and jax.default_backend() == "cpu":
        options = {**(options or {}), **cpu_options}
    return options


def jit(fn: Callable, dtype: str, *, cpu_options: Mapping | None = None, **jit_kwargs) -> Callable:
    """`jax.jit(fn, **jit_kwargs)` for a program computing in `dtype`, compiled with `jitted_options`."""
    return jax.jit(fn, compiler_options=jitted_options(dtype, cpu_options), **jit_kwargs)


class jit_by_config:  # noqa: N801 (used as a decorator, like jax.jit)
    """A decorator: `fn`, whose `config` keyword argument is static, jitted with the compiler options of
    `config.dtype` (`compiler_options`), chosen at each call, and `cpu_options` besides where the backend is the CPU.
    Its static arguments are keyword-only. `.compile_ahead(...)` (on arguments or their shapes) compiles the
    program a later call with such arguments runs. Where `use_cache(..., programs=True)` turned `ProgramStore` on,
    a call runs the stored program (`_cache_size` does not count those), and `.compile_ahead` reads or stores it.
    `.lower` is the plain jitted function's, store or not."""

    def __init__(self, fn: Callable, *, static_argnames: tuple[str, ...], cpu_options: Mapping | None = None) -> None:
        parameters = inspect.signature(fn).parameters
        for name in static_argnames:  # a static argument given by position would be keyed by its shape alone
            if name not in parameters or parameters[name].kind is not inspect.Parameter.KEYWORD_ONLY:
                raise TypeError(f"{fn.__qualname__}: static argument {name!r} must be keyword-only")
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
        if _programs is None:
            return self._for(config.dtype)(*args, config=config, **kwargs)
        program, traced = self._stored(args, config, kwargs)
        return program(*args, **traced)

    def lower(self, *args, config, **kwargs):
        return self._for(config.dtype).lower(*args, config=config, **kwargs)

    def compile_ahead(self, *args, config, **kwargs) -> None:
        """Compiles what `self(*args, config=config, **kwargs)` will run (a compile-ahead job; the arguments may be
        jax.ShapeDtypeStruct): the plain jit's program, or where the store is on, the stored one."""
        if _programs is None:
            self.lower(*args, config=config, **kwargs).compile()  # fills the cache a later call looks in
            return
        program, traced = self._stored(args, config, kwargs)
        if isinstance(program, _PlainJit):
            program.lower(*args, **traced).compile()

    def _stored(self, args: tuple, config, kwargs: dict) -> tuple[Any, dict]:
        """(the store's program for these arguments, the keyword arguments it takes: all but the static ones)."""
        static = {"config": config, **{k: v for k, v in kwargs.items() if k in self._static_argnames}}
        traced = {k: v for k, v in kwargs.items() if k not in static}
        options = jitted_options(config.dtype, self._cpu_options)
        make_jitted = functools.partial(self._for, config.dtype)  # traced only where the store has no program
        return _programs.program(self._fn, make_jitted, args, traced, static, options), traced

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


def use_cache(setting: str | None, warn: Callable[[str], None] = print, programs: bool = False) -> Path | None:
    """Turns the persistent compilation cache on in the folder `setting` (None: `default_cache_dir()`), or off
    ("off"); `programs`: and `ProgramStore` in its `programs` subfolder (what the project's runs ask: a training
    run stores the decoders it compiles ahead, and a `translate` after it finds them). Returns the folder in use,
    or None when off. A folder that cannot be created is a warning, not an error: a run never fails for want of a
    cache."""
    from jax.experimental.compilation_cache import compilation_cache

    global _programs
    current = jax.config.values["jax_compilation_cache_dir"]
    _programs = None
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
    if programs and _can_serialize_exports():
        _programs = ProgramStore(folder / PROGRAMS, warn)
    return folder


def _can_serialize_exports() -> bool:
    """Whether jax.export can write its format here (it needs the flatbuffers package)."""
    try:
        from jax._src.export import serialization  # noqa: F401
    except ImportError:
        return False
    return True


PROGRAMS = "programs"  # the subfolder of the compilation cache that ProgramStore keeps its programs in
EXPORTED, NOT_EXPORTED = ".jax_exported", ".not_exported"  # a stored program's file; a program jax.export refused


def _brief(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _shape(leaf, device: jax.Device | None = None) -> jax.ShapeDtypeStruct:
    """An argument's shape, dtype and weak type (of an array, a number or a shape), on `device` if given."""
    aval = jax.typeof(leaf)
    sharding = None if device is None else jax.sharding.SingleDeviceSharding(device)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=sharding)


def exportable(cls):
    """A class decorator for a pytree node class that programs take or return (a flax.struct.dataclass whose static
    fields hold Python literals: numbers, strings, tuples, None): registers it with jax.export so that
    `ProgramStore` can save programs that carry it."""
    from jax import export

    export.register_pytree_node_serialization(
        cls,
        serialized_name=f"{cls.__module__}.{cls.__qualname__}",
        serialize_auxdata=lambda aux: repr(tuple(aux)).encode(),
        deserialize_auxdata=lambda data: ast.literal_eval(data.decode()),  # tuples come back as tuples
    )
    return cls


@functools.cache
def _package_digest(root: Path | None = None) -> str:
    """sha256 of this package's Python source, every sub-package's too: an edit to the model or the decoders changes
    what they trace to."""
    root = root or Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _signature(fn: Callable, leaves: list, tree, static: Mapping[str, Any], options) -> tuple:
    """What `fn`'s program is traced from, as objects: itself, its static arguments, the tree and avals of its
    traced arguments (`leaves` and `tree`, flattened: arrays, or their shapes as a compile-ahead job gives them),
    the compile options and jax's trace settings. In memory a program is found by it, cheaper to make than the
    text of its key. Placement is not in it: a stored program
    holds arguments on one device (`_device`), and jax traces a program the same whichever device that is (the
    store compiles it for each device it is called on)."""
    avals = tuple(jax.typeof(leaf) for leaf in leaves)
    return fn, tuple(sorted(static.items())), tree, avals, tuple(sorted((options or {}).items())), _trace_settings()


def _device(leaves: list) -> jax.Device | None:
    """The one device the arrays among `leaves` are on (where none is placed: jax's default device, else this
    process's first); None where some are laid out over several devices, or are on different ones, or are traced
    (a call inside another jit, which a compiled program cannot take): those arguments take the plain jit."""
    devices = set()
    for leaf in leaves:
        if isinstance(leaf, jax.core.Tracer):
            return None
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            devices |= sharding.device_set
    if len(devices) > 1:
        return None
    if devices:
        return next(iter(devices))
    default = jax.config.values["jax_default_device"]
    return default if isinstance(default, jax.Device) else jax.local_devices()[0]


class _PlainJit:
    """The plain jitted function with its static arguments bound, called and lowered as a stored program is."""

    def __init__(self, jitted: Callable, static: Mapping[str, Any]) -> None:
        self._jitted, self._static = jitted, dict(static)

    def __call__(self, *args, **kwargs):
        return self._jitted(*args, **kwargs, **self._static)

    def lower(self, *args, **kwargs):
        return self._jitted.lower(*args, **kwargs, **self._static)


def _trace_settings() -> str:
    """The jax settings a trace depends on, as jax's own caches key on them (the calling thread's: context managers
    such as jax.default_matmul_precision included), without object addresses; every global setting where that
    private function is missing."""
    try:
        from jax._src.config import trace_context

        settings = repr(trace_context())
    except ImportError:
        settings = repr(sorted(jax.config.values.items()))
    return re.sub(r" at 0x[0-9a-fA-F]+", "", settings)


class ProgramStore:
    """Decoding programs saved as traced, so that a new process does not trace and lower them again.

    JAX's persistent cache keys a compiled program on its lowered HLO: a new process still traces and lowers every
    program before the cache can answer, which was most of a warm-cache `translate`'s start (docs/benchmarks.md,
    "Starting a translate"). This store keeps each `jit_by_config` program as `jax.export` writes it (its StableHLO,
    argument shapes and trees), under a key of what it is traced from: the function, its static arguments, the
    shapes, dtypes and tree structure of its other arguments, the compile options, jax's trace settings, and the
    environment (this package's source files, the jax, jaxlib, flax, numpy and ml_dtypes versions, the backend and
    its devices, XLA_FLAGS, the machine). An edited source file, another version or setting makes another key. Not
    seen: a module constant of this package changed at run time (the tests that do so leave the store off). A
    stored program runs as `jax.jit(exported.call)` compiled for its arguments' shapes on one device, through jax's
    persistent cache; arguments laid out over several devices take the plain jit. A training run stores the
    decoders it compiles ahead, so that a `translate` after it on sentences of the same shapes finds them traced
    and compiled (the plain jit's HLO differs: export keeps the arguments a program does not read).

    Saved executables (jax.experimental.serialize_executable) would skip the compile step too, but on XLA:CPU some
    of ours could not be serialized ("`LessThan` is not serializable": a sort's comparator), and one that was
    failed when run in the next process ("Function compare_reduce_fusion not found"). jax.export's format is the
    one jax keeps stable across processes and versions.

    A program that cannot be read or compiled is traced again and written over; one that cannot be exported (a
    custom call jax.export refuses, such as cuDNN's attention) runs as the plain jit, and an empty `.not_exported`
    file spares the next process the attempt (a warning, once per store): a run never fails for the store. Nothing
    is evicted: delete the folder to reclaim its space. Like jax's cache, the folder holds code that the process
    runs: never point it at a folder others may write to."""

    def __init__(self, folder: Path, warn: Callable[[str], None] = print) -> None:
        self.folder, self._warn = Path(folder), warn
        self._programs: dict[tuple, jax.stages.Compiled | _PlainJit] = {}  # by (signature, device)
        self._locks: dict[tuple, threading.Lock] = {}
        self._lock = threading.Lock()
        self._warned = False
        self.counts = {"read": 0, "written": 0, "not saved": 0}

    @functools.cached_property
    def _environment(self) -> str:
        import flax
        import jaxlib
        import ml_dtypes
        import numpy

        devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
        backend = jax.devices()[0].client
        environ = [os.environ.get(name) for name in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")]
        versions = (jax.__version__, jaxlib.__version__, flax.__version__, numpy.__version__, ml_dtypes.__version__)
        return repr((_package_digest(), versions, backend.platform_version, devices, environ, platform.machine()))

    def key(self, fn: Callable, dynamic, static: Mapping[str, Any], options) -> str:
        """The key of `fn` traced on `dynamic` (its traced arguments, any pytree) with `static`, compiled with
        `options`: on disk, the name of its file."""
        leaves, tree = jax.tree_util.tree_flatten(dynamic)
        return self._key(_signature(fn, leaves, tree, static, options))

    def _key(self, signature: tuple) -> str:
        """`signature` (`_signature`'s) as text without object addresses, with the environment: a sha256."""
        fn, static, tree, avals, options, settings = signature
        described = (fn.__module__, fn.__qualname__, [(k, repr(v)) for k, v in static], str(tree))
        text = repr((described, [str(aval) for aval in avals], list(options), settings, self._environment))
        return hashlib.sha256(text.encode()).hexdigest()

    def program(
        self, fn: Callable, make_jitted: Callable, args: tuple, kwargs: dict, static: dict, options
    ) -> jax.stages.Compiled | _PlainJit:
        """What to call with (*args, **kwargs) for `fn(*args, **kwargs, **static)`
        jitted with `options` (`make_jitted()`: that jitted function); the arguments may be arrays or their shapes
        (jax.ShapeDtypeStruct). The stored program (in memory, or read from the folder), else the jitted function's,
        exported and saved, compiled for the arguments' shapes on one device; the plain jit where it cannot be."""
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))  # once: every call of a decoder comes here
        device = _device(leaves)
        if device is None:
            return _PlainJit(make_jitted(), static)
        signature = _signature(fn, leaves, tree, static, options)
        compiled_for = (signature, device)  # in memory: a program compiled for one device runs there
        with self._lock:
            if compiled_for in self._programs:
                return self._programs[compiled_for]
            lock = self._locks.setdefault(compiled_for, threading.Lock())
        with lock:  # threads that need the same program read or export it once
            if compiled_for not in self._programs:
                try:
                    program = self._find(self._key(signature), make_jitted, (args, kwargs), static, options, device)
                except Exception as e:  # the plain jit runs (and raises again if the program itself is at fault)
                    self._warn_once(f"warning: a decoding program did not go through {self.folder} ({_brief(e)})")
                    program = None
                with self._lock:
                    self._programs[compiled_for] = program or _PlainJit(make_jitted(), static)
        return self._programs[compiled_for]

    def _find(
        self, key: str, make_jitted: Callable, dynamic: tuple, static: dict, options, device: jax.Device
    ) -> jax.stages.Compiled | None:
        """The stored program of `key`, compiled (read, else exported and written); None: run the plain jit.
        It is exported from the arguments' shapes, and compiled for them on `device`, so that the same program
        lowers to the same HLO whether a call or a compile-ahead job asks, in this process or the next one: jax's
        persistent cache then finds what a training run compiled ahead for the `translate` after it."""
        if self._path(key, NOT_EXPORTED).is_file():
            return None
        args, kwargs = jax.tree_util.tree_map(functools.partial(_shape, device=device), dynamic)

        def compiled(exported) -> jax.stages.Compiled:
            return jax.jit(exported.call, compiler_options=options).lower(*args, **kwargs).compile()

        exported = self._read(key)
        if exported is not None:
            try:
                return compiled(exported)
            except Exception as e:  # a file that reads but does not compile: exported again, and written over
                self._warn_once(f"warning: stored program {self._path(key)} could not be compiled ({_brief(e)})")
        exported = self._export(key, make_jitted(), jax.tree_util.tree_map(_shape, dynamic), static)
        return None if exported is None else compiled(exported)

    def _path(self, key: str, suffix: str = EXPORTED) -> Path:
        return self.folder / f"{key}{suffix}"

    def _read(self, key: str):
        from jax import export

        path = self._path(key)
        if not path.is_file():
            return None
        try:
            exported = export.deserialize(bytearray(path.read_bytes()))
        except Exception as e:  # a truncated or foreign file: trace the program again and write over it
            self._warn_once(f"warning: stored program {path} could not be read ({_brief(e)})")
            return None
        self._count("read")
        return exported

    def _export(self, key: str, jitted: Callable, shapes: tuple, static: dict):
        """`jitted` exported on `shapes` ((args, kwargs)) and written; read back as the next process will read it."""
        from jax import export

        args, kwargs = shapes
        try:
            data = export.export(jitted)(*args, **kwargs, **static).serialize()
        except Exception as e:  # e.g. a custom call jax.export refuses: not tried again by the next process
            self._count("not saved")
            self._warn_once(f"warning: a decoding program was not saved in {self.folder} ({_brief(e)})")
            self._write(self._path(key, NOT_EXPORTED), b"")
            return None
        if self._write(self._path(key), data):
            self._count("written")
        return export.deserialize(data)

    def _write(self, path: Path, data: bytes) -> bool:
        """`data` into `path`, whole or not at all (for a process reading beside this one); False where it cannot."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            files.write_bytes(path, data)
        except OSError as e:
            self._count("not saved")
            self._warn_once(f"warning: a decoding program was not saved in {self.folder} ({_brief(e)})")
            return False
        return True

    def _count(self, what: str) -> None:
        with self._lock:  # compile-ahead threads store programs side by side
            self.counts[what] += 1

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            self._warn(message)


def cache_entries(folder: str | os.PathLike) -> int:
    """Compiled programs stored in a cache folder (jax writes one `<key>-cache` file per program)."""
    folder = Path(folder)
    return sum(1 for p in folder.iterdir() if p.name.endswith("-cache")) if folder.is_dir() else 0


class CompileLog:
    """Running totals of compilation in this process, from jax.monitoring: `compiles` (XLA compiles or cache
    loads), `traces` (Python functions traced to programs), `seconds` (tracing + lowering + compiling, all
    threads), `thread_seconds` (those of the calling thread only: what it spent compiling rather than waiting for
    another thread), persistent cache `hits` and `misses`.
    One listener is registered per process (jax offers no way to scope one); differences of snapshots give what
    happened in between."""

    _lock = threading.Lock()
    _totals = {"compiles": 0, "traces": 0, "seconds": 0.0, "hits": 0, "misses": 0}
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
                cls._totals["traces"] += event == _COMPILE_EVENTS[0]
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


def simulate_cpu_devices(count: int) -> None:
    """JAX's CPU backend as `count` devices (XLA's --xla_force_host_platform_device_count), for compiling a mesh's
    programs on a machine without them (`train.py plan --devices`); set before JAX starts its backends."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={count}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
