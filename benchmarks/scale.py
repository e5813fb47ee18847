"""Sections 6 and 7 of the benchmark: gradient accumulation, and two processes on loopback against one.

Accumulation (section_accumulate, in this process, one device): the same global batch in one step (K=1) and in
K=4 micro-batches inside one compiled step (`train.py train --accumulate 4`), interleaved. Accumulation exists
for memory, so the figures carry the compiled step's temporary memory (XLA's `memory_analysis()`: activations,
gradients and other buffers of one call; the state is not counted) as a ratio and in the note.

Two processes (section_multihost): the sharded jit step on MULTIHOST_DEVICES simulated CPU devices, once in one
process that sees them all and once as two processes on 127.0.0.1 with half of them each, joined by
`jax.distributed` (gloo collectives over loopback), on the same global batch. Each configuration is its own set of
child processes (`child_multihost`), so the two cannot be interleaved step by step: they run one after the other,
and on a loaded machine the comparison is rough. Process 0's step times are reported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from benchmarks.children import RUN, child_args, child_env, run_child
from benchmarks.report import add_ratio, figure, ratio
from benchmarks.train_step import JaxTrain, interleaved, training_batch
from tests.helpers.configs import preset_config
from tests.helpers.twins import ported_params

if TYPE_CHECKING:
    from benchmarks.common import Settings

ACCUMULATE = 4
MULTIHOST_DEVICES = 4


# =============================================================================================================
# Section 6: gradient accumulation
# =============================================================================================================


def section_accumulate(s: Settings, figures: list, failures: list, state: dict) -> None:
    """K=ACCUMULATE micro-batches in one step against one step on the whole batch: time and compiled memory."""
    if s.batch_size % ACCUMULATE:
        failures.append(
            {"name": "accumulate", "error": f"--batch-size {s.batch_size} is not divisible by {ACCUMULATE}"}
        )
        return
    for name in s.aux_presets:
        config = preset_config(name, s.vocab)
        batch = training_batch(config, s.batch_size, s.length)
        params, _ = ported_params(config)
        runners, first_s, memory = {}, {}, {}
        for k in (1, ACCUMULATE):
            label = f"K={k}"
            runner = JaxTrain(config, batch, params, accumulate=k)
            start = time.perf_counter()
            runner()  # compiles
            first_s[label] = time.perf_counter() - start
            for _ in range(s.warmup - 1):
                runner()
            memory[label] = runner.temp_memory()
            runners[label] = runner
        times = interleaved(runners, s.repeats_for(name), desc="accumulate", failures=failures, context="accumulate")
        figs = {}
        for label, seconds in times.items():
            if not seconds:
                continue
            rows = s.batch_size // int(label[2:])
            note = (
                f"accumulate {name}: global batch {s.batch_size} x {s.length} tokens on 1 device; compiled step's "
                f"temporary memory (XLA memory_analysis): "
                + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in memory.items())
            )
            what = f"one {s.batch_size}-row batch" if rows == s.batch_size else f"{rows}-row micro-batches"
            figs[label] = figure(
                f"accumulate {name}: {label} ({what})",
                "ms/step",
                seconds,
                lambda t: 1e3 * t,
                section="accumulate",
                preset_name=name,
                note=note + f"; first call (compile + step) {label} {first_s[label]:.1f} s",
            )
        k = f"K={ACCUMULATE}"
        if "K=1" in figs and k in figs:
            add_ratio(figs[k], f"{k}/K=1", ratio(figs[k], figs["K=1"]))
            add_ratio(figs[k], f"temp memory {k}/K=1", memory[k] / memory["K=1"])
        figures.extend(figs.values())


# =============================================================================================================
# Section 7: two processes on loopback against one
# =============================================================================================================


def child_multihost(s: Settings, coordinator: str | None, num_processes: int | None, process_id: int | None) -> dict:
    """In a child process (one of two, or alone): join the others, then time the sharded step on the global
    batch after warm-up steps. The first thing it does with jax is `jax.distributed.initialize`."""
    import jax

    from jax_transformer.settings.config import ParallelConfig
    from jax_transformer.training import distributed

    parallel = ParallelConfig(
        coordinator=coordinator, num_processes=num_processes, process_id=process_id, heartbeat_timeout=30
    )
    distributed.initialize(parallel, print_fn=lambda text: None)
    config = preset_config(s.presets[0], s.vocab)  # the parent passes its model as --presets (child_args)
    batch = training_batch(config, s.batch_size, s.length)
    params, _ = ported_params(config)
    runner = JaxTrain(config, batch, params, parallel="sharded")
    warmup_s = []
    for _ in range(max(2, s.warmup)):
        start = time.perf_counter()
        runner()
        warmup_s.append(time.perf_counter() - start)
    times = []
    for _ in range(s.repeats_for(s.presets[0])):
        start = time.perf_counter()
        runner()
        times.append(time.perf_counter() - start)
    return {
        "times": times,
        "warmup_s": warmup_s,
        "devices": jax.device_count(),
        "processes": jax.process_count(),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_two_processes(args: list[str], timeout: float = 1800) -> dict:
    """The two children of the two-process figure; process 0's JSON result."""
    import json

    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={MULTIHOST_DEVICES // 2}"
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(RUN),
                *args,
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            env=child_env(XLA_FLAGS=flags.strip()),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [proc.communicate(timeout=timeout) for proc in procs]
    for proc, (out, err) in zip(procs, outputs):
        if proc.returncode != 0:
            tail = (err or out).strip().splitlines()[-5:]
            raise RuntimeError(f"two-process child exited with {proc.returncode}: " + " | ".join(tail))
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def section_multihost(s: Settings, figures: list, failures: list, state: dict) -> None:
    """The sharded step over MULTIHOST_DEVICES simulated devices: one process against two on loopback."""
    if s.batch_size % MULTIHOST_DEVICES:
        failures.append(
            {"name": "multihost", "error": f"--batch-size {s.batch_size} is not divisible by {MULTIHOST_DEVICES}"}
        )
        return
    name = s.aux_presets[0]
    args = [
        "--child",
        "multihost",
        *child_args(s, name),
        "--repeats",
        str(s.repeats_for(name)),
        "--warmup",
        str(s.warmup),
    ]
    results = {}
    print(f"  [{name}] sharded jit on {MULTIHOST_DEVICES} simulated devices: 1 process, then 2 (subprocesses)")
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={MULTIHOST_DEVICES}"
    try:
        results["1 process"] = run_child(args, child_env(XLA_FLAGS=flags.strip()))
        results["2 processes"] = _run_two_processes(args)
    except Exception as e:
        failures.append({"name": f"multihost/{name}", "error": f"{type(e).__name__}: {e}"})
    figs = {}
    for label, result in results.items():
        calls = ", ".join(f"{t:.1f}" for t in result["warmup_s"])
        figs[label] = figure(
            f"sharded jit {name}: {label}, {result['devices']} devices",
            "ms/step",
            result["times"],
            lambda t: 1e3 * t,
            section="multihost",
            preset_name=name,
            note=f"multihost {name}: global batch {s.batch_size} x {s.length} tokens; {MULTIHOST_DEVICES} simulated "
            f"CPU devices on the machine's {s.torch_threads} cores, in 1 process or 2 joined by jax.distributed over "
            f"127.0.0.1 (gloo); run one after the other, not interleaved; untimed warm-up calls ({label}) {calls} s",
        )
    if len(figs) == 2:
        add_ratio(figs["2 processes"], "2 processes/1", ratio(figs["2 processes"], figs["1 process"]))
    figures.extend(figs.values())
