"""jax_transformer.host_memory: memory a thread frees stays in the process for the next allocation (glibc's malloc),
and `train.py train` asks for it before JAX starts."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="the settings are glibc malloc's"
)

# What XLA:CPU does at every call of a program, from a thread of its own: allocate a scratch buffer larger than a
# thread arena's 64 MB heap, write it, free it. Page faults counted for that thread alone, per round.
CHILD = """
import ctypes, resource, sys, threading
from jax_transformer import host_memory

if sys.argv[1] == "after-a-thread":  # a thread that allocates, and so gets an arena of its own
    started = threading.Thread(target=lambda: bytearray(2**20))
    started.start()
    started.join()
kept = host_memory.keep_freed_memory() if sys.argv[1] != "defaults" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 100 * 2**20
faults = []

def scratch():
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        block = libc.malloc(SIZE)
        ctypes.memset(block, 1, SIZE)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

thread = threading.Thread(target=scratch)
thread.start()
thread.join()
print(kept, *faults)
"""
PAGES = 100 * 2**20 // 4096  # 25,600 pages of 4 KiB in the block


def child(mode: str) -> tuple[str, list[int]]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    return out[0], [int(x) for x in out[1:]]


def transparent_huge_pages_always() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.is_file() and "[always]" in path.read_text()


@glibc_only
def test_freed_memory_is_reused_without_faulting_it_in_again():
    kept, faults = child("keep")
    assert kept == "True"
    # The first round grows the heap (every page faults once); later rounds reuse it. A few hundred faults of
    # slack for whatever else the thread touches (its stack, the interpreter's objects): 1% of the block's pages.
    assert max(faults[1:]) < PAGES // 100, f"page faults per round after the first: {faults}"
    if not transparent_huge_pages_always():  # (huge pages would make the defaults fault 512 times less)
        # The same rounds with the C library's defaults fault the whole block in every time: the check above
        # could fail.
        defaults, faults = child("defaults")
        assert min(faults) > PAGES // 2, f"page faults per round with glibc's defaults: {faults}"


@glibc_only
def test_nothing_changes_once_other_threads_run():
    # Threads that have allocated have arenas of their own: the settings would hold for some of them only.
    kept, faults = child("after-a-thread")
    assert kept == "False"


def test_train_keeps_freed_memory_before_jax_starts_unless_told_not_to(monkeypatch):
    import train
    from jax_transformer import host_memory, run

    class Started(Exception):
        pass

    calls = []
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: calls.append("kept") or True)

    def train_run(**_):
        calls.append("run")
        raise Started

    monkeypatch.setattr(run, "train", train_run)
    for flags, expected in (([], ["kept", "run"]), (["--no-keep-freed-memory"], ["run"])):
        calls.clear()
        args = train.build_parser().parse_args(["train", *flags])
        with pytest.raises(Started):
            args.func(args, 0.0)
        assert calls == expected, flags
