"""Keep the memory a compiled program frees for the next call, instead of handing it back to the kernel.

On a CPU, every call of a compiled program allocates its scratch buffer as it starts and frees it as it ends (tens
of MB for a training step). glibc's malloc serves each thread other than the main one from an arena of its own,
whose heaps hold at most 64 MB; a larger block is mapped apart (mmap) and unmapped when freed, so the next call's
first write to each of its 4 KiB pages is a page fault, and the kernel zeroes the page: a noticeable share of a
small model's step (docs/benchmarks.md, "Freed memory kept"). One arena for all threads (the main one, whose heap
grows with no such limit), no mmap, and no trimming of the heap's top keep a freed block in the process, and the
next call reuses it.

The cost: what the process frees stays its own, reused by later allocations but not given back to the system, so
its resident memory stays near its peak; and all threads share one arena's lock. Worth it where JAX computes on the
CPU; nothing to gain where it computes on a GPU or TPU, where `keep_freed_memory` leaves malloc alone
(`jax_runs_on_cpu` tells which, before JAX starts).

Written here because it has to happen from inside the process: glibc reads the same settings from the environment
only as a process starts (`MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647`, as an allocator
such as tcmalloc or jemalloc would have to be preloaded), while `mallopt` sets them at run time, for the arenas and
blocks made after the call. So `keep_freed_memory` acts only while the main arena is the only one, before jax
starts its threads (its backend starts with the first computation), as in `train.py train`; in a process whose
threads already have arenas of their own (a notebook, a test run) it changes nothing and returns False.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import pkgutil
import platform
import tempfile

# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
# The heap's top goes back to the system once this much of it is free: the most mallopt takes (an int).
_TRIM_THRESHOLD = 2**31 - 1


def jax_runs_on_cpu() -> bool:
    """Whether JAX's default backend will be the CPU, told without starting JAX: $JAX_PLATFORMS names the CPU first,
    or, where it is not set, no accelerator is installed (GPU plugins are modules of the `jax_plugins` namespace or
    entry points of that group, as jax finds them; a TPU needs `libtpu`)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    if importlib.metadata.entry_points(group="jax_plugins"):
        return False
    namespace = importlib.util.find_spec("jax_plugins")
    if namespace is not None and any(pkgutil.iter_modules(namespace.submodule_search_locations or [])):
        return False
    return importlib.util.find_spec("libtpu") is None


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to keep freed memory in the process (see the module's docstring). True where it did;
    False, changing nothing, where JAX will not compute on the CPU (`jax_runs_on_cpu`), the C library is not glibc
    (macOS, musl), threads other than the main one have allocated memory already (they have arenas of their own),
    or glibc could not say how many arenas it has."""
    if not jax_runs_on_cpu() or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL("libc.so.6")
    if _arenas(libc) != 1:  # threads with arenas of their own: the settings would hold for some threads only
        return False
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return all([libc.mallopt(parameter, value) == 1 for parameter, value in settings])  # each one set, in order


def _arenas(libc: ctypes.CDLL) -> int:
    """How many arenas malloc has made, one per `<heap nr=...>` element of glibc's `malloc_info` report; 0 where the
    report could not be written (the caller then changes nothing)."""
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    try:
        with tempfile.NamedTemporaryFile("r", prefix="malloc-info-") as report:
            stream = libc.fopen(os.fsencode(report.name), b"w")
            if not stream:
                return 0
            try:
                written = libc.malloc_info(0, stream) == 0
            finally:
                libc.fclose(stream)
            return report.read().count("<heap nr=") if written else 0
    except OSError:  # no temporary folder to write the report in
        return 0
