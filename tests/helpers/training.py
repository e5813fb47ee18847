"""Shared pieces of the training tests: a tiny corpus on disk, train.py flags for a seconds-long run, and runners.

The in-process unit-test model, optimiser and batch (unit_config, unit_optim, unit_batch) and `flat` are in
tests/helpers/configs.py and batches.py."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The numbers 0..299 as English -> French words (the built-in task's pairs): short sentences (one or two batch
# shapes, so few compilations) and a tokenizer that trains in a fraction of a second.
N_TRAIN = 300


def write_corpus(directory: Path, *, empty_line: bool = False, long_line: bool = False) -> Path:
    """train.tsv with the pairs of 0..N_TRAIN-1. Optionally line 5 gets an empty target and line 7 a pair far
    longer than max_len, to exercise --on-empty / --on-too-long."""
    from jax_transformer.data.default_task import number_pair

    lines = ["\t".join(number_pair(n)) for n in range(N_TRAIN)]
    if empty_line:
        lines[4] = lines[4].split("\t")[0] + "\t"
    if long_line:
        lines[6] = " ".join(["seven hundred and seventy-seven thousand"] * 8) + "\t" + "sept cent " * 20
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "train.tsv"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def tiny_train_args(
    run_dir: Path,
    train: Path,
    *,
    steps: int,
    save_every: int = 1000,
    valid: Path | None = None,
    extra: tuple[str, ...] = (),
    compile_cache: Path | None = None,
) -> list[str]:
    """train.py flags for a one-layer tiny model that trains in seconds: short sentences, max_len 16 and packed
    batches (32 rows x 16, five per epoch: one compilation); without `valid` nothing is evaluated. JAX's persistent
    compilation cache is the session's (conftest.py: $JAX_COMPILATION_CACHE_DIR, never the user's) unless a folder
    is given."""
    args = [
        "train",
        "--tsv",
        str(train),
        "--preset",
        "tiny",
        "--num-encoder-layers",
        "1",
        "--num-decoder-layers",
        "1",
        "--vocab-size",
        "100",
        "--tokenizer-type",
        "bpe",
        "--max-len",
        "16",
        "--max-tokens",
        "512",
        "--warmup-steps",
        "20",
        "--lr-scale",
        "2",
        "--steps",
        str(steps),
        "--eval-every",
        "1000",
        "--save-every",
        str(save_every),
        "--eval-sentences",
        "0",
        "--samples",
        "0",
        "--no-progress",
        "--run-dir",
        str(run_dir),
    ]
    if compile_cache is not None:
        args += ["--compilation-cache", str(compile_cache)]
    if valid is not None:
        args += ["--valid-tsv", str(valid)]
    return args + list(extra)


def run_main(argv: list[str]) -> tuple[int, str, str]:
    """Calls cli.main(argv) in this process; returns (exit code, stdout, stderr), argparse's exit included.
    Without --compilation-cache its programs go to the session's cache (conftest.py), never the user's."""
    assert os.environ.get("JAX_COMPILATION_CACHE_DIR"), "conftest.py sets the session's compilation cache"
    sys.path.insert(0, str(REPO))
    try:
        from jax_transformer.cli import main as cli
    finally:
        sys.path.remove(str(REPO))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as stop:  # argparse's exit 2 for a bad flag (or 0 for --help), as the command's
            code = stop.code
    return code, out.getvalue(), err.getvalue()


def report_on_cpu_devices(module: str, devices: int) -> dict:
    """Runs `python -m module` in a child process with `devices` simulated CPU devices (the CPU backend, also on a
    GPU machine) and returns the JSON of its "REPORT {...}" line; fails with its output if it exits non-zero."""
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
    )
    result = subprocess.run(
        [sys.executable, "-m", module], capture_output=True, text=True, env=env, cwd=str(REPO), timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads(result.stdout.split("REPORT ", 1)[1].splitlines()[0])


def start_train_process(
    argv: list[str],
    log: Path,
    compile_cache: Path | None = None,
    pause: tuple[Path, str, int] | None = None,
    devices: int | None = None,
) -> subprocess.Popen:
    """train.py in a child process (its own jax), output to `log`. Processes given the same `compile_cache`
    folder share compiled XLA programs (jax's persistent compilation cache, `--compilation-cache`; the tiny model's
    programs compile in under the 1 s jax caches by default, hence the threshold 0), so the second one starts
    fast. pause=(marker, "step" | "save", k): the process blocks after step k, or inside the save of step k, once
    it has written `marker` (tests/helpers/pause_at.py), for a SIGKILL at exactly that point.
    `devices`: that many simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # The parent's XLA flags pass on (on a GPU machine conftest.py's deterministic-ops flag, which the bitwise
    # comparisons of resumed runs need), all but a simulated device count, which is this call's to choose.
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
        env["JAX_PLATFORMS"] = "cpu"  # simulated CPU devices, also on a machine whose default backend is a GPU
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    if compile_cache is not None:
        env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
        argv = [*argv, "--compilation-cache", str(compile_cache)]
    command = [sys.executable, str(REPO / "train.py")]
    if pause is not None:
        marker, kind, point = pause
        command = [sys.executable, "-m", "tests.helpers.pause_at", str(marker), kind, str(point)]
    with open(log, "wb") as f:
        return subprocess.Popen([*command, *argv], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))


def wait_for(condition, process: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    """Polls `condition()` until true; fails if the process exits first or the timeout passes."""
    deadline = time.time() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"train.py exited ({process.returncode}) early:\n{log.read_text()[-3000:]}")
        if time.time() > deadline:
            process.kill()
            raise AssertionError(f"timed out waiting; log:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def kill_at_pause(
    process: subprocess.Popen, marker: Path, log: Path, *, condition=None, before_kill=None, timeout: float = 180.0
) -> str:
    """Waits (polling) until a process started with `pause=` reaches its pause (and `condition()` holds, e.g. a
    background save has completed), calls `before_kill()`, SIGKILLs it there and returns what the marker says
    (its pid and where it paused)."""
    import signal

    try:
        wait_for(lambda: marker.exists() and (condition is None or condition()), process, log, timeout)
        if before_kill is not None:
            before_kill()
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGKILL, log.read_text()[-3000:]
    return marker.read_text().strip()


def free_port() -> int:
    """A TCP port nobody listens on now (the system's choice), for a coordinator on 127.0.0.1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_flags(port: int, count: int, index: int, heartbeat: int = 5, init: int = 60) -> list[str]:
    """train.py flags that make a process `index` of `count` joined through a coordinator on 127.0.0.1:port.
    Heartbeat 5 s: a dead peer stops the others within seconds. The join timeout is longer, because processes
    started together on a loaded 2-core machine may reach it many seconds apart."""
    return [
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        str(count),
        "--process-id",
        str(index),
        "--heartbeat-timeout",
        str(heartbeat),
        "--init-timeout",
        str(init),
    ]


def finish(processes: list[subprocess.Popen], logs: list[Path], timeout: float = 300.0) -> list[int]:
    """Waits for every process (killing all if one outlives the timeout); their exit codes."""
    deadline = time.time() + timeout
    try:
        for process, log in zip(processes, logs):
            try:
                process.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"train.py still running after {timeout} s; log:\n{log.read_text()[-3000:]}"
                ) from None
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [process.returncode for process in processes]


def completed_steps(run_dir: Path) -> list[int]:
    """Finished checkpoint steps on disk: orbax renames a step's temporary folder to its number when done."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count('"kind": "train"') if path.exists() else 0
