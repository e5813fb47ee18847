"""jax_transformer.training.host_memory: memory a thread frees stays in the process for the next allocation (glibc's
malloc), and `train.py train` asks for it before JAX starts."""

from __future__ import annotations

import os
import platform
import resource
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
from jax_transformer.training import host_memory

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
PAGES = 100 * 2**20 // resource.getpagesize()  # 25,600 pages of 4 KiB in the block


def child(code: str, *args: str, **env_vars: str) -> list[str]:
    # Without the environment's own malloc settings (GLIBC_TUNABLES, MALLOC_ARENA_MAX, ...), which would decide
    # what the defaults do.
    # JAX_PLATFORMS=cpu: the setting is for a process whose JAX computes on the CPU (on a GPU machine too).
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    env.update({"JAX_PLATFORMS": "cpu", **env_vars})
    run = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.split()


@glibc_only
def test_freed_memory_is_reused_without_faulting_it_in_again():
    kept, *faults = child(CHILD, "keep")
    faults = [int(x) for x in faults]
    assert kept == "True"
    # The first round grows the heap (each page faults once); later rounds reuse it. Some slack for whatever else
    # the thread touches (its stack, the interpreter's objects): 1% of the block's pages.
    assert max(faults[1:]) < PAGES // 100, f"page faults per round after the first: {faults}"
    if faults[0] > PAGES // 2:  # faults counted page by page here (not under huge pages, nor a sandbox counting none)
        # The same rounds with the C library's defaults fault the whole block in every time: so the check above
        # is not vacuous.
        _, *faults = child(CHILD, "defaults")
        assert min(int(x) for x in faults) > PAGES // 2, f"page faults per round with glibc's defaults: {faults}"


@glibc_only
def test_nothing_changes_once_another_thread_has_allocated():
    # Threads that have allocated have arenas of their own: the settings would hold for some of them only.
    kept, *_ = child(CHILD, "after-a-thread")
    assert kept == "False"


@glibc_only
def test_nothing_changes_where_jax_computes_on_an_accelerator():
    kept, *_ = child(CHILD, "keep", JAX_PLATFORMS="cuda")  # (the child never starts JAX: no GPU is needed)
    assert kept == "False"


@glibc_only
def test_train_py_sets_it_before_any_other_thread_allocates():
    # train.main's own imports (jax, flax, orbax through the run module) and flag parsing, then `train` as far as
    # the call, with the run itself left out: the settings are taken.
    code = """
from jax_transformer.cli import main as cli
from jax_transformer.training import host_memory
from jax_transformer.training import run

taken = host_memory.keep_freed_memory

def keep_freed_memory():
    print("kept", taken())
    return True

def train_run(**_):
    raise SystemExit(0)

host_memory.keep_freed_memory, run.train = keep_freed_memory, train_run
cli.main(["train", "--no-progress"])
"""
    assert child(code) == ["kept", "True"]


def test_jax_runs_on_cpu_follows_jax_platforms_else_the_installed_accelerators(monkeypatch):
    from jax_transformer.training import host_memory

    for platforms, expected in (("cpu", True), ("cpu,cuda", True), ("cuda,cpu", False), ("tpu", False)):
        monkeypatch.setenv("JAX_PLATFORMS", platforms)
        assert host_memory.jax_runs_on_cpu() is expected, platforms
    monkeypatch.delenv("JAX_PLATFORMS")
    real_find_spec = host_memory.importlib.util.find_spec
    monkeypatch.setattr(
        host_memory.importlib.util, "find_spec", lambda name: object() if name == "libtpu" else real_find_spec(name)
    )
    assert host_memory.jax_runs_on_cpu() is False  # libtpu installed: a TPU machine


def test_train_keeps_freed_memory_before_jax_starts_unless_told_not_to(monkeypatch):
    from jax_transformer.cli import main as cli
    from jax_transformer.training import host_memory, run

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
        args = cli.build_parser().parse_args(["train", *flags])
        with pytest.raises(Started):
            args.func(args, 0.0)
        assert calls == expected, flags
