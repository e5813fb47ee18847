"""Sections 3 and 5 of the benchmark, measured in child processes: the time to the first step, and data parallel
steps over simulated devices.

Time to the first step (section_first_step): what a user waits for before training starts, JAX's trace + compile
+ run of the first step against torch eager's first step. A process that has compiled or imported anything
before would hide part of it, so every figure comes from a fresh process (`child_first_step`) with the
persistent caches off (jax's compilation cache, a new empty Inductor cache: run.py's isolate_caches, called in
every process before jax or torch is imported); import and model set-up times are reported in the note, not
counted.

Data parallel (section_pmap): pmap and sharded jit (a Mesh over the devices, the batch split by rows) over
PMAP_DEVICES simulated CPU devices against single-device jit on the same global batch. The devices exist only if
XLA_FLAGS=--xla_force_host_platform_device_count=N is set before jax starts, so all three run in one child process
started with it (`child_pmap`), interleaved as everywhere.

A child is benchmarks/run.py itself with the internal --child flag; it prints its result as JSON on the last line
of its stdout (`run_child`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.report import add_ratio, figure, ratio
from benchmarks.train_step import (
    JAX_LABEL,
    TORCH_VARIANTS,
    JaxTrain,
    TorchTrain,
    interleaved,
    set_torch_threads,
    training_batch,
)
from tests.helpers.configs import preset_config
from tests.helpers.twins import ported_params

if TYPE_CHECKING:
    from benchmarks.common import Settings

REPO = Path(__file__).resolve().parent.parent
RUN = Path(__file__).resolve().with_name("run.py")  # what a child process runs, with --child
PMAP_DEVICES = 4


# =============================================================================================================
# Running a child
# =============================================================================================================


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a fresh benchmark subprocess: persistent caches off and a fresh Inductor directory (the
    child's run.py calls isolate_caches, see the top of this file), the repository importable."""
    env = dict(os.environ)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the child makes its own empty one
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra)
    return env


def run_child(args: list[str], env: Mapping[str, str], timeout: float = 1800) -> dict:
    """Runs benchmarks/run.py with --child ... and returns the JSON object its last stdout line holds."""
    proc = subprocess.run(
        [sys.executable, str(RUN), *args], env=dict(env), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"child {' '.join(args)} exited with {proc.returncode}: " + " | ".join(tail))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_args(s: Settings, name: str) -> list[str]:
    """run.py flags that give a child the parent's model (preset `name`), batch and memory setting."""
    memory = "--keep-freed-memory" if s.freed_memory_kept else "--no-keep-freed-memory"
    shape = ["--batch-size", str(s.batch_size), "--length", str(s.length), "--vocab", str(s.vocab)]
    return ["--presets", name, *shape, memory]


# =============================================================================================================
# Section 3: time to the first step, in fresh processes
# =============================================================================================================


def child_first_step(framework: str, s: Settings) -> dict:
    """In a fresh process: import, build the state, then time the first step (JAX: trace + compile + run)."""
    t0 = time.perf_counter()
    config = preset_config(s.presets[0], s.vocab)
    batch = training_batch(config, s.batch_size, s.length)
    if framework == "jax":
        import jax

        jax.config.update("jax_enable_compilation_cache", False)
        t_import = time.perf_counter()
        params, _ = ported_params(config)
        runner = JaxTrain(config, batch, params)
    else:
        import torch  # noqa: F401  (its import is timed as import, not as set-up)

        set_torch_threads(s.torch_threads)
        t_import = time.perf_counter()
        runner = TorchTrain(config, batch, None, "default")  # torch's own init: no jax in this process
    t_setup = time.perf_counter()
    runner()
    t_first = time.perf_counter()
    runner()
    t_second = time.perf_counter()
    return {
        "import_s": t_import - t0,
        "setup_s": t_setup - t_import,
        "first_step_s": t_first - t_setup,
        "second_step_s": t_second - t_first,
    }


def section_first_step(s: Settings, figures: list, failures: list, state: dict) -> None:
    """Time to the first finished step in a fresh process: JAX (trace + compile + run) vs torch eager."""
    from tqdm.auto import tqdm

    labels = {"jax": JAX_LABEL, "torch": TORCH_VARIANTS["default"]}
    for name in s.presets:
        results: dict[str, list[dict]] = {fw: [] for fw in labels}
        for _ in tqdm(range(s.first_step_runs), desc=f"first step {name}", unit="run", leave=False):
            for fw in labels:  # interleaved, as everywhere
                try:
                    results[fw].append(
                        run_child(["--child", "first-step", "--framework", fw, *child_args(s, name)], child_env())
                    )
                except Exception as e:
                    failures.append({"name": f"first-step/{name}: {labels[fw]}", "error": f"{type(e).__name__}: {e}"})
        figs = {}
        for fw, runs in results.items():
            if not runs:
                continue
            imports = statistics.median(r["import_s"] for r in runs)
            setup = statistics.median(r["setup_s"] for r in runs)
            later = statistics.median(r["second_step_s"] for r in runs)
            figs[fw] = figure(
                f"first step {name}: {labels[fw]}",
                "s",
                [r["first_step_s"] for r in runs],
                section="first-step",
                preset_name=name,
                note=f"{labels[fw]}, {name}: fresh process; not counted: import {imports:.1f} s, "
                f"model/optimiser setup {setup:.1f} s; the second step took {later:.2f} s",
            )
        if "jax" in figs and "torch" in figs:
            add_ratio(figs["jax"], f"JAX/{labels['torch']}", ratio(figs["jax"], figs["torch"]))
        figures.extend(figs.values())


# =============================================================================================================
# Section 5: pmap over simulated devices
# =============================================================================================================


PARALLEL_LABELS = {"jit": "jit", "pmap": "pmap", "sharded": "sharded jit"}  # --parallel mode -> figure label


def child_pmap(s: Settings) -> dict:
    """In a process that sees PMAP_DEVICES CPU devices: single-device jit, pmap and sharded jit over all of them,
    on the same global batch, interleaved."""
    import jax

    devices = jax.local_device_count()
    if devices < PMAP_DEVICES:
        raise RuntimeError(
            f"expected {PMAP_DEVICES} CPU devices (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}), jax sees {devices}"
        )
    config = preset_config(s.presets[0], s.vocab)
    batch = training_batch(config, s.batch_size, s.length)
    params, _ = ported_params(config)
    failures: list[dict] = []
    runners, warmup_s = {}, {}
    for mode, label in PARALLEL_LABELS.items():
        runner = JaxTrain(config, batch, params, parallel=mode)
        # At least two warm-up calls: pmap compiles a second time on its second call when the replicated input
        # state's sharding (from flax's replicate) differs from the sharding of the state it returns.
        warmup_s[label] = []
        for _ in range(max(2, s.warmup)):
            start = time.perf_counter()
            runner()
            warmup_s[label].append(time.perf_counter() - start)
        runners[label] = runner
    times = interleaved(runners, s.repeats_for(s.presets[0]), desc="pmap", failures=failures, context="pmap")
    return {"times": times, "warmup_s": warmup_s, "devices": devices, "failures": failures}


def section_pmap(s: Settings, figures: list, failures: list, state: dict) -> None:
    """pmap and sharded jit over simulated CPU devices vs jit on one, the same global batch (rows split over
    devices)."""
    if s.batch_size % PMAP_DEVICES:
        failures.append(
            {"name": "pmap", "error": f"--batch-size {s.batch_size} is not divisible by {PMAP_DEVICES} devices"}
        )
        return
    flags = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={PMAP_DEVICES}").strip()
    for name in s.aux_presets:
        print(f"  [{name}] jit vs pmap vs sharded jit over {PMAP_DEVICES} simulated devices (subprocess)", flush=True)
        try:
            result = run_child(
                [
                    "--child",
                    "pmap",
                    *child_args(s, name),
                    "--repeats",
                    str(s.repeats_for(name)),
                    "--warmup",
                    str(s.warmup),
                ],
                child_env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu"),  # simulated CPU devices, also on a GPU machine
            )
        except Exception as e:
            failures.append({"name": f"pmap/{name}", "error": f"{type(e).__name__}: {e}"})
            continue
        failures.extend(result["failures"])
        figs = {}
        for label, times in result["times"].items():
            if not times:
                continue
            calls = ", ".join(f"{t:.1f}" for t in result["warmup_s"][label])
            note = (
                f"{label} {name}: global batch {s.batch_size} x {s.length} tokens; {PMAP_DEVICES} simulated CPU "
                f"devices share the machine's {s.torch_threads} cores; untimed warm-up calls took {calls} s"
            )
            devices = "1 device" if label == "jit" else f"{PMAP_DEVICES} devices"
            figs[label] = figure(
                f"{label} {name}: {devices}",
                "ms/step",
                times,
                lambda t: 1e3 * t,
                section="pmap",
                preset_name=name,
                note=note,
            )
        for label in ("pmap", "sharded jit"):
            if "jit" in figs and label in figs:
                add_ratio(figs[label], f"{label}/jit", ratio(figs[label], figs["jit"]))
        if "pmap" in figs and "sharded jit" in figs:
            add_ratio(figs["sharded jit"], "sharded jit/pmap", ratio(figs["sharded jit"], figs["pmap"]))
        figures.extend(figs.values())
