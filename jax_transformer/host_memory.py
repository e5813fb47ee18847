"""Keep the memory a compiled program frees for the next call, instead of handing it back to the kernel.

On a CPU, every call of a compiled program allocates its scratch buffer as it starts and frees it as it ends: 83 MB
for the small preset's training step. glibc's malloc serves each thread other than the main one from an arena of
its own, whose heaps hold at most 64 MB; a larger block is mapped apart (mmap) and unmapped when freed, so the next
call's first write to each of its 4 KiB pages is a page fault, and the kernel zeroes the page: tens of thousands of
faults per step, about a tenth of the small preset's step on a 2-core CPU (docs/benchmarks.md, "Freed memory
kept"). One arena for all threads (the main one, whose heap grows with no such limit), no mmap, and no trimming of
the heap's top keep a freed block in the process, and the next call reuses it. The cost: what the process frees
stays its own (reused by later allocations) instead of going back to the system.

Written here because it has to happen from inside the process: glibc reads the same settings from $GLIBC_TUNABLES
only as a process starts (as an allocator such as tcmalloc or jemalloc would have to be preloaded), while `mallopt`
sets them at run time, for the arenas and blocks made after the call. So `keep_freed_memory` acts only while the
main arena is the only one, before jax starts its threads (its backend starts with the first computation), as in
`train.py train`; in a process whose threads already have arenas of their own (a notebook, a test run) it changes
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import tempfile

# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
# The heap's top is given back to the system once this much of it is free: mallopt takes an int, and 2 GiB is far
# above any scratch buffer of this project's programs on a CPU (the base preset's step: a few hundred MB).
_TRIM_THRESHOLD = 2**31 - 1


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to keep freed memory in the process (see the module's docstring). True where it did;
    False, changing nothing, where the C library is not glibc (macOS, musl) or threads other than the main one
    have allocated memory already (they have arenas of their own)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if _arenas(libc) > 1:  # threads with arenas of their own: the settings would hold for some threads only
        return False
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)


def _arenas(libc: ctypes.CDLL) -> int:
    """How many arenas malloc has made: one per `<heap nr=...>` element of glibc's `malloc_info` report."""
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    with tempfile.NamedTemporaryFile("r", prefix="malloc-info-") as report:
        stream = libc.fopen(report.name.encode(), b"w")
        if not stream or libc.malloc_info(0, stream) != 0:
            raise OSError(f"glibc's malloc_info could not write its report to {report.name}")
        libc.fclose(stream)
        return report.read().count("<heap nr=")
